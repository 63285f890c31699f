"""Slurm for forge: the job's state read by its id in every ``squeue --json`` schema
(``queue``), hostlist expressions (``hostlist``), and the adapter of Monarch's ``SlurmJob``
that starts, watches and cancels a run's job (``job``). Import ``job`` only where Monarch may be
imported; the other two are plain Python."""
