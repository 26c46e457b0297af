"""examples/train_char_gpt.py (the main job), with GPT-2's initialization when MWX_INIT=gpt2: weights and embeddings
N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 n_layer)), biases 0 (docs/huggingface.md, "Why"); the example
itself is not changed. Run as a module, from the repository root: ``deepspeed --num_gpus 2 --master_port PORT --module
benchmarks.hf_gap_main --deepspeed_config CONFIG --n-layer 2 --max-steps 200``.
"""
import os, sys, math
import torch
from examples import train_char_gpt as t

if os.environ.get("MWX_INIT") == "gpt2":
    _init = t.CharGPT.__init__
    def init(self, vocab_size, block_size, n_layer, n_embd, n_head):
        _init(self, vocab_size, block_size, n_layer, n_embd, n_head)
        std = float(os.environ.get("MWX_STD", "0.02"))
        with torch.no_grad():
            for name, mod in self.named_modules():
                if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                    s = std / math.sqrt(2 * n_layer) if name.endswith("attn.proj") or name.endswith("mlp.2") else std
                    mod.weight.normal_(0, s)
                    if getattr(mod, "bias", None) is not None:
                        mod.bias.zero_()
        if int(os.environ.get("RANK", "0")) == 0:
            print("MWX gpt2 init", float(self.tok_emb.weight.std()), float(self.blocks[0].attn.proj.weight.std()), flush=True)
    t.CharGPT.__init__ = init

if __name__ == "__main__":
    t.main()
