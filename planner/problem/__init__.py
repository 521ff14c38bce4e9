"""The problem and its costs: the program IR, schedules and strategies, cost tables and their models, the
`Problem`, its programs and its simulated step. The bottom of the planner: imports nothing else of it."""
