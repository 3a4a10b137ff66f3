"""Worker side of deltacast: the replica that rebuilds requests and the receiving transport."""
