"""Developer tools that know the whole repository (the core and both integrations); not part of the package."""
