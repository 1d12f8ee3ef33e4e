"""Pricing a solved plan: the parameter communication schedule, runner-ups for ``explain``, symbolic
costs at another batch; and what each pipeline schedule costs (``schedules``)."""
