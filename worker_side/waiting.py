"""The worker's waiting policy (pure: imported by the demo and benches without zmq).

After each step a worker spins on its receive (non-blocking polls with
``sched_yield``) for ``DEFAULT_SPIN_MS``, then blocks; heartbeats do not restart
the spin, so an idle worker sleeps.
"""

DEFAULT_SPIN_MS = 1000.0  # as vLLM's shm readers (SpinCondition.busy_loop_s)
