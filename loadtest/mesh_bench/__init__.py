"""Benchmarks through a whole `splitserve up` mesh (loadtest.mesh.MeshProcess): a burst of
prompts (burst.py), the KV hand-off gap per transport (handoff.py), an idle mesh's CPU
(idle.py). The one subtle rule: each starts its own mesh and stops it, failure or not.
"""
