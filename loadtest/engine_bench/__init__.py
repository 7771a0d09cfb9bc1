"""Micro-benchmarks of shared/engine and shared/kvtransfer, in one process (or two for kv):
the engine end to end (engine.py, burst.py, quant.py, spec.py, gpu.py), one forward step by
stage (step.py), attention (attention.py), the matmuls (linear.py), KV block transfer
(kv.py, kv_sender.py), and the machine's own peaks to hold figures against
(machine_share.py). The one subtle rule: they import the engine's internals, so the runtime
(services/, shared/) never imports them; `splitserve bench` reaches them through
loadtest/bench_cli.py, one import per target when it runs.
"""
