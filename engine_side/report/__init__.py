"""Wire-size reports: replay workloads through every format, account bytes per field."""
