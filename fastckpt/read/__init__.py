"""How a load runs: ``loader`` verifies and rebuilds a state, ``load_into`` reads into an existing one,
``readers`` does the parallel ranged reads, ``verify`` checks a checkpoint completely."""
