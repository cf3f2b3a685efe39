"""Starting a hub: server processes on one machine, or Ray actors on a cluster."""
