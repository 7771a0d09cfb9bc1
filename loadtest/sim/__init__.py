"""`splitserve bench sim`: a discrete-event simulator of a splitserve mesh.

Modelled workers (worker.py, over kv.py) step like the engine's continuous batching, with
step times from a cost model (cost_model.py); the scheduler's own registry, routing and path
choice place their requests (mesh.py, over services/scheduler); a planner's `decide` sets
roles and pool sizes (planner_hook.py). run.py replays `bench slo`'s workloads and reports in
its shape; compare.py sets a simulation beside a measured `slo.json`. docs/simulator.md.
"""
