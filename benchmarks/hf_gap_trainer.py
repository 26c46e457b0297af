"""Why the recommended method trails stock on the Trainer job (docs/huggingface.md, "Why"): examples/hf_trainer_gpt2.py
with one thing changed at a time, chosen by environment variables (the example itself is not changed):

- HFX_TIE=0: untied input and output embeddings (GPT-2 ties them);
- HFX_INIT=torch: PyTorch's default initialization (the main job's: embeddings N(0, 1), linear layers uniform in
  +-1/sqrt(fan_in)) instead of GPT-2's N(0, 0.02);
- HFX_BETA2=0.99: AdamW's beta2 (the Trainer's default 0.999; the main job's 0.99), through TrainingArguments;
- HFX_FULLTEXT=1: random blocks of the first 90% of the text (the main job's training text) instead of its first
  200k characters;
- HFX_LOGLR=1 (default): rank 0 writes the learning rate of every owners' step (the sign step) to
  runs/hfexp/$HFX_NAME.signlr.json, to compare with the Trainer's logged learning rates.

Run as a module, from the repository root: ``deepspeed --num_gpus 2 --master_port PORT --module
benchmarks.hf_gap_trainer --stock --max-steps 200 --warmup-steps 60 --grad-accum 2 --bf16``.
"""
import json, math, os, sys
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import deepspeed_dgc  # noqa
from examples import hf_common, hf_trainer_gpt2
import deepspeed_dgc.zero3.optimizer as zo

name = os.environ.get("HFX_NAME", "x")
rank = int(os.environ.get("RANK", "0"))
if os.environ.get("HFX_LOGLR", "1") == "1":
    orig = zo._owners_step
    seen = []
    def logged(optimizer, closure, decoupled, direction):
        seen.append([float(g["lr"]) for g in optimizer.param_groups])
        return orig(optimizer, closure, decoupled, direction)
    zo._owners_step = logged
    import atexit
    def dump():
        if rank == 0:
            os.makedirs(f"{ROOT}/runs/hfexp", exist_ok=True)
            with open(f"{ROOT}/runs/hfexp/{name}.signlr.json", "w") as f:
                json.dump(seen, f)
    atexit.register(dump)

beta2 = os.environ.get("HFX_BETA2")
eps = os.environ.get("HFX_EPS")
orig_load = hf_common.load_ds_config
def load(path, stock):
    c = orig_load(path, stock)
    if eps:
        c["optimizer"]["params"]["eps"] = float(eps)
        return c
hf_common.load_ds_config = load
if beta2:
    import transformers
    _ti = transformers.TrainingArguments.__init__
    def _init(self, *a, **k):
        k["adam_beta2"] = float(beta2)
        _ti(self, *a, **k)
    transformers.TrainingArguments.__init__ = _init

tie = os.environ.get("HFX_TIE", "1") == "1"
init = os.environ.get("HFX_INIT", "gpt2")
npos = os.environ.get("HFX_NPOS")
def gpt2(args, vocab_size):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=vocab_size, n_positions=int(npos) if npos else args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=4, bos_token_id=0, eos_token_id=0,
                        initializer_range=args.init_range, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                        attn_pdrop=args.dropout, tie_word_embeddings=tie)
    m = GPT2LMHeadModel(config)
    if init == "torch":  # PyTorch's defaults, as the main job's CharGPT gets them
        g = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for mod in m.modules():
                cls = type(mod).__name__
                if cls == "Embedding":
                    mod.weight.normal_(0, 1, generator=g)
                elif cls in ("Conv1D", "Linear") and mod.weight is not m.transformer.wte.weight:
                    fan_in = mod.weight.shape[0] if cls == "Conv1D" else mod.weight.shape[1]
                    b = 1 / math.sqrt(fan_in)
                    mod.weight.uniform_(-b, b, generator=g)
                    if getattr(mod, "bias", None) is not None:
                        mod.bias.uniform_(-b, b, generator=g)
    if rank == 0:
        print("HFX model tie", m.lm_head.weight is m.transformer.wte.weight, "init", init,
              "wte std", float(m.transformer.wte.weight.std()), flush=True)
    return m
hf_common.gpt2 = gpt2

if os.environ.get("HFX_FULLTEXT") == "1":  # the main job's training text: the first 90% of the file, not 200k chars
    def char_data(args, world_size):
        text = hf_common.DATA_PATH.read_text(encoding="utf-8")
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([stoi[c] for c in text[:int(0.9 * len(text))]], dtype=torch.long)
        length = args.max_steps * args.grad_accum * args.batch_size * world_size
        return hf_common.CharBlocks(ids, args.block_size, length, args.seed), len(chars)
    hf_common.char_data = char_data

if __name__ == "__main__":
    hf_trainer_gpt2.main()
