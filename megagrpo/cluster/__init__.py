"""The cluster: process topology and groups, process-group start, hostfiles, the memory planner."""
