"""The core: the fold, the rules and what they read and return. Pure: no file, clock, event loop,
HTTP or Kubernetes; everything it knows came in as an input, everything it wants done goes out as data."""
