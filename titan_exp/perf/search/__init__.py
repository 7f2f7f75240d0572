"""The planner: which layouts of a model on N devices validate (layouts), at which splits of the
global batch, with which other settings searched (axes), ranked by the cost model (planner), and a
plan written as a named sweep (sweep)."""
