"""What a checkpoint is: the plan of a state, the codecs and checks of what is read back, and one small module
per on-disk format (``layout`` the open layout, ``torchfile`` a torch file, ``bundle`` a framework's files),
each behind the ``FileFormat`` protocol of ``protocol.py``."""
