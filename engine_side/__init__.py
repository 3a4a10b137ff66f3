"""Engine side of deltacast: the mirror of worker state and the sending transport."""
