"""Timing constants of the pipeline layer, in one place."""

#: Longest a worker or a Loader waits inside one blocking hub call before it checks for a
#: stop request or a failed run; readiness itself is pushed by the hub, not polled.
POLL_S = 0.05

#: After a run is stopped, how long ``run`` waits for workers still inside a stage function.
STOP_GRACE_S = 10.0

#: Dead stage workers (killed, crashed, lost with their node) that the process and Ray
#: executors replace per run before the run fails.
MAX_RESTARTS = 3
