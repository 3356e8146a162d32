"""Where checkpoints live: the shared-memory tier (``shm``, ``shm_load``, ``recovery``), the local catalog
and its housekeeping (``catalog``, ``gc``, ``lock``), the remote tier (``remote``) and both catalogs seen as
one (``union``)."""
