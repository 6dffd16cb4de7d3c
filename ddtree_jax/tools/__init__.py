"""Tools around the engine: profiling, tree pictures, the code sandbox."""
