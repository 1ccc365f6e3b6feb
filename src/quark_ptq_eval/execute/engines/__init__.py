"""The engines' child processes that are packages of their own (file2file); the engines themselves,
what the plan chooses among, are plan/engines/."""
