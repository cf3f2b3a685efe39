"""Weight sync between a trainer and rollout engines (no hub involved)."""
