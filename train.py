"""`python train.py --config configs/tiny.yaml [--set k=v ...]` from a checkout: the same as the
console script `rembert-train`. The command line lives in megatron_rembert/train.py."""

from megatron_rembert.train import console_main

if __name__ == "__main__":
    console_main()
