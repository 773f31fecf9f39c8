import torch

# The suite runs many tiny forwards; one thread per process keeps them fast and steady on a
# small shared machine (two threads contend with each other and with the test runner).
torch.set_num_threads(1)
