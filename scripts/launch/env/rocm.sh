# AMD Instinct MI300X nodes (ROCm; torch's "nccl" backend is RCCL). Sourced by scripts/launch/slurm.sbatch.
# RCCL reads the NCCL_* names. The network lines depend on the cluster: set them for yours.
export HSA_FORCE_FINE_GRAIN_PCIE=1            # peer-to-peer transport between the node's GPUs
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1      # a failed collective ends the job instead of hanging it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=<bootstrap interface, e.g. ens50f0>
# export NCCL_IB_HCA=<RDMA NICs, e.g. rdma0,rdma1,...,rdma7>  # one per GPU on rail-optimized nodes
# export NCCL_IB_GID_INDEX=3                  # RoCE v2 fabrics
