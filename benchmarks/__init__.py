"""Developer benchmarks (not part of the installed package): scripts, and the library they share in `lib`."""
