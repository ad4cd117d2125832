"""What every other folder uses: owned threads, exit handling, crash-injection points."""
