# NVIDIA nodes (CUDA, NCCL). Sourced by scripts/launch/slurm.sbatch.
# The network lines depend on the cluster: set them for yours.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1      # a failed collective ends the job instead of hanging it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=<bootstrap interface, e.g. eth0>
# export NCCL_IB_HCA=<InfiniBand HCAs, e.g. mlx5_0,mlx5_1,...>
