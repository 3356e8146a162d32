"""How a save runs: ``saver`` turns a state into a job, ``staging`` owns the host buffers, ``pipeline`` drives
the copy thread, the I/O workers and the committer, ``handle`` is what a caller holds while it runs."""
