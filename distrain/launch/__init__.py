"""Starting and stopping runs: torchrun's elastic agent, Slurm batch scripts, the run-directory
lock, workers that die with their launcher, preemption signals and the checks made before any
worker starts."""
