"""The compile service: routing a spec to a backend, compiling it once, caching it, warming up."""
