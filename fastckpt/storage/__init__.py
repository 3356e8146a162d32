"""Where bytes go: the ``Storage`` protocol and ``open_storage`` (``protocol.py``), the local fast path
(``local.py``; its links and removals that keep the GIL: ``heldlink.py``; background removals that yield to a
user's ``rmtree``: ``yieldremove.py``), every fsspec backend (``fsspec.py``) and the
deadlines of its requests (``deadline.py``)."""
