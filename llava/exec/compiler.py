"""The compiler settings the engine's compiles need, set in the thread that compiles.

torch keeps its compiler settings per thread (context variables): set at import, in the main
thread, they were not in force in the engine loop's thread, where every compile of a served
engine runs (a test run's ninth flex graph failed there, ``FailOnRecompileLimitHit``, under
dynamo's default limit of 8; and the GPU's compile failures read ``SubprocException``, the
compile workers' error, though in-process compiles had been asked for). So each thread that
runs the model sets them: the importing thread (llava.exec.attention) and the loop's
(``Runner.enter_thread``).
"""

from __future__ import annotations

import torch._dynamo
import torch._inductor.config

# Each model geometry, pool size and row bucket is its own flex graph (llava.exec.attention):
# a test run's many small models need more than dynamo's default of 8.
RECOMPILE_LIMIT = 64


def for_this_thread(in_process: bool = False) -> None:
    """Raise dynamo's recompile limit to ``RECOMPILE_LIMIT`` for the calling thread; with
    ``in_process``, have inductor compile in it too (``compile_threads`` 1), so that a failed
    compile raises its own error rather than a compile worker's ``SubprocException``."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    if in_process:
        torch._inductor.config.compile_threads = 1
