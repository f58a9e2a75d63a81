#!/usr/bin/env python3
"""diffusers run with the settings `sdhost bench --peer diffusers` gives it, for side-by-side timings.

sdhost runs this script in a child process (`python - ARGS`, the script on stdin; it is compiled
into the sdhost binary) once per precision: f32 and bf16 on the CPU, f16 and bf16 on a CUDA GPU
(`--device cuda`, when sdhost ran on a cudaN device).  It prints ONE JSON object on stdout,
the same shape as bench/peer-sdcpp prints:

  {"system": str, "load_s": float, "first_run_s": float, "peak_host_bytes": int|null,
   "runs": [{"total_s", "te_s", "sampling_s", "vae_s", "unet_calls"}, ...]}

Stages, as sdhost's bench times them: text encode = every CLIP forward (prompt and negative),
sampling = from the end of text encoding to the start of VAE decoding (UNet calls with CFG's batch
of two, scheduler steps), VAE decode = `vae.decode`, end to end = one pipeline call.  `load_s` is
reading the checkpoint and building the three models; `first_run_s` is the warm-up generation.

Offline by construction: the single-file checkpoint's architecture is read from its tensor shapes
and written as an ldm `original_config` YAML into a temporary folder, which diffusers'
`from_single_file` turns into model configs (no hub access: no config, no tokenizer files are
fetched).  The CLIP tokenizer is built from the BPE vocabulary open_clip_torch ships.

SDXL (an sgm single-file checkpoint: conditioner.embedders.0 CLIP-L, conditioner.embedders.1 OpenCLIP
bigG) is built directly: the UNet's, the VAE's and both text encoders' configs are read off the tensor
shapes (heads of 64 channels, as SDXL and sdhost have them), the weights go through diffusers' own
converters, and StableDiffusionXLPipeline runs them (its second tokenizer pads with "!", diffusers'
SDXL default).  Its VAE decodes in the dtype asked (force_upcast, which would decode f16 in f32, is
off; the report says so).

FLUX.1 (`--t5xxl`, `--clip-l`, `--vae`, `--t5-tokenizer` given; --model the transformer in BFL's names,
.safetensors or .gguf) is built from its parts: configs read off the shapes as sdhost reads them, GGUF blocks
dequantized at load (the gguf package) into the dtype asked, T5 in transformers' or llama.cpp's names, the T5
tokenizer over the vocabulary sdhost ships, FluxPipeline with FlowMatchEulerDiscreteScheduler (schnell: no
shift, 256 T5 tokens; dev: BFL's shift, 512 tokens, --guidance).

FLUX.2 klein (`--llm`, `--vae`, `--qwen-merges` given) likewise: Flux2KleinPipeline over the transformer (BFL's
names), its Qwen3 (transformers' or llama.cpp's names; a GGUF's own vocabulary where it has one, else the merges
sdhost ships) and AutoencoderKLFlux2 (BFL's layout); distilled at CFG 1, base above. Full-size transformers are
built on the meta device and take the loaded tensors themselves; parts too large for the host's memory in the
dtype asked are "not comparable".

Z-Image (`--family zimage` with `--llm`, `--vae`, `--qwen-merges`): ZImagePipeline over the transformer (Tongyi's
original names), the Qwen3's base model and FLUX.1's autoencoder, shifted by 3, CFG where sdhost's is above 1
(guidance_scale = sdhost's CFG - 1).

Exit status: 0 with the report; 3 "unavailable: ..." (Python packages missing); 4 "not
comparable: ..." (settings diffusers cannot reproduce, checkpoint neither SD 1.x, SDXL, nor FLUX.1, FLUX.2 klein or Z-Image in parts); anything
else is a failure.  Every message is one line on stderr.
"""

import argparse
import json
import os
import sys
import tempfile
import time

EXIT_UNAVAILABLE = 3
EXIT_NOT_COMPARABLE = 4


def cpu_flags():
    """The processor's feature flags as Linux lists them in /proc/cpuinfo, or None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def fail(code, msg):
    print(" ".join(str(msg).split()), file=sys.stderr)
    sys.exit(code)


# sdhost sampler name -> (diffusers scheduler class, extra kwargs).  What diffusers has no
# equivalent for is refused: a different sampler would time a different computation.
SAMPLERS = {
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpm2": ("KDPM2DiscreteScheduler", {}),
    "dpm2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpm++2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpm++2m_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}),
    "lms": ("LMSDiscreteScheduler", {}),
    "ddim": ("DDIMScheduler", {"set_alpha_to_one": False}),
}

# sdhost schedule name -> scheduler kwarg that selects it (None: the default spacing).
SCHEDULES = {
    "discrete": None,
    "karras": "use_karras_sigmas",
    "exponential": "use_exponential_sigmas",
}

# SD 1.x's training schedule (the ldm config's linear_start/linear_end, "scaled_linear" betas).
SD1_SCHEDULE = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    timestep_spacing="linspace", steps_offset=1)

TE = "cond_stage_model.transformer.text_model."
UNET = "model.diffusion_model."
VAE = "first_stage_model."


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="a photo of a cat")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg-scale", type=float, default=7.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--sampler", default="euler_a")
    p.add_argument("--scheduler", default="discrete")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the models run; on cuda every timing point waits for the GPU")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-warm-up", action="store_true", help="measure the first run too")
    # FLUX.1 in parts (the transformer is --model): T5-XXL, CLIP-L, the autoencoder, the T5
    # vocabulary sdhost ships, and dev's distilled guidance.
    p.add_argument("--t5xxl")
    p.add_argument("--clip-l")
    p.add_argument("--vae")
    p.add_argument("--t5-tokenizer")
    p.add_argument("--guidance", type=float, default=3.5)
    # FLUX.2 klein in parts (the transformer is --model): its Qwen3 (--llm), the autoencoder
    # (--vae) and the Qwen merges sdhost ships.
    p.add_argument("--llm")
    p.add_argument("--qwen-merges")
    p.add_argument("--family", choices=["flux2", "zimage"], default="flux2",
                   help="which family --llm goes with (FLUX.2 klein or Z-Image)")
    return p.parse_args()


def sd1_original_config(shapes):
    """The ldm (CompVis) config of an SD 1.x single-file checkpoint, read off its tensor shapes.

    SD 1.x has 8 attention heads at every level (ldm num_heads: 8), which shapes cannot show; sdhost
    uses the same rule."""
    if TE + "embeddings.token_embedding.weight" not in shapes:
        fail(EXIT_NOT_COMPARABLE, "not comparable: the diffusers peer runs SD 1.x single-file checkpoints "
             f"(no {TE}embeddings.token_embedding.weight; SD 2.x is not mapped)")
    if UNET + "label_emb.0.0.weight" in shapes:
        fail(EXIT_NOT_COMPARABLE, "not comparable: the UNet has an ADM input (SDXL-like), not SD 1.x")
    conv_in = shapes[UNET + "input_blocks.0.0.weight"]
    model_channels, in_channels = conv_in[0], conv_in[1]
    if in_channels != 4:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: the UNet takes {in_channels} input channels (inpainting); "
             "bench runs text-to-image")
    levels = [[]]  # per level: (out channels, has attention, transformer depth) of each res block
    k = 1
    context_dim = None
    while UNET + f"input_blocks.{k}.0.op.weight" in shapes or UNET + f"input_blocks.{k}.0.out_layers.3.weight" in shapes:
        if UNET + f"input_blocks.{k}.0.op.weight" in shapes:
            levels.append([])
        else:
            out = shapes[UNET + f"input_blocks.{k}.0.out_layers.3.weight"][0]
            depth = 0
            while UNET + f"input_blocks.{k}.1.transformer_blocks.{depth}.attn2.to_k.weight" in shapes:
                context_dim = shapes[UNET + f"input_blocks.{k}.1.transformer_blocks.{depth}.attn2.to_k.weight"][1]
                depth += 1
            levels[-1].append((out, depth))
        k += 1
    if not levels[0] or any(len(lv) != len(levels[0]) for lv in levels):
        fail(EXIT_NOT_COMPARABLE, f"not comparable: unexpected UNet layout in input_blocks ({levels})")
    if context_dim is None:
        fail(EXIT_NOT_COMPARABLE, "not comparable: the UNet has no cross-attention")
    channel_mult = []
    attention_resolutions = []
    depths = set()
    for i, lv in enumerate(levels):
        if lv[0][0] % model_channels:
            fail(EXIT_NOT_COMPARABLE, f"not comparable: level {i} width {lv[0][0]} is no multiple of {model_channels}")
        channel_mult.append(lv[0][0] // model_channels)
        if lv[0][1]:
            attention_resolutions.append(2 ** i)
            depths.add(lv[0][1])
    if len(depths) > 1:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: transformer depth differs between levels ({sorted(depths)})")

    vae_ch = shapes[VAE + "encoder.conv_in.weight"][0]
    vae_mult = []
    i = 0
    while VAE + f"encoder.down.{i}.block.0.conv2.weight" in shapes:
        vae_mult.append(shapes[VAE + f"encoder.down.{i}.block.0.conv2.weight"][0] // vae_ch)
        i += 1
    vae_blocks = 0
    while VAE + f"encoder.down.0.block.{vae_blocks}.conv1.weight" in shapes:
        vae_blocks += 1
    z_channels = shapes[VAE + "decoder.conv_in.weight"][1]
    embed_dim = shapes[VAE + "post_quant_conv.weight"][0]

    return {
        "model": {
            "target": "ldm.models.diffusion.ddpm.LatentDiffusion",
            "params": {
                "linear_start": 0.00085,
                "linear_end": 0.012,
                "timesteps": 1000,
                "scale_factor": 0.18215,
                "unet_config": {
                    "target": "ldm.modules.diffusionmodules.openaimodel.UNetModel",
                    "params": {
                        "image_size": 32,
                        "in_channels": in_channels,
                        "out_channels": shapes[UNET + "out.2.weight"][0],
                        "model_channels": model_channels,
                        "attention_resolutions": attention_resolutions,
                        "num_res_blocks": len(levels[0]),
                        "channel_mult": channel_mult,
                        "num_heads": 8,
                        "transformer_depth": depths.pop() if depths else 1,
                        "context_dim": context_dim,
                        "use_checkpoint": False,
                        "legacy": False,
                    },
                },
                "first_stage_config": {
                    "target": "ldm.models.autoencoder.AutoencoderKL",
                    "params": {
                        "embed_dim": embed_dim,
                        "ddconfig": {
                            "double_z": True,
                            "z_channels": z_channels,
                            "resolution": 256,
                            "in_channels": shapes[VAE + "encoder.conv_in.weight"][1],
                            "out_ch": shapes[VAE + "decoder.conv_out.weight"][0],
                            "ch": vae_ch,
                            "ch_mult": vae_mult,
                            "num_res_blocks": vae_blocks,
                            "attn_resolutions": [],
                            "dropout": 0.0,
                        },
                    },
                },
                "cond_stage_config": {"target": "ldm.modules.encoders.modules.FrozenCLIPEmbedder"},
            },
        }
    }


def te_config(shapes, te=TE):
    """CLIP text encoder config from shapes; heads = max(1, hidden / 64) as in sdhost (CLIP ViT-L/14: 12)."""
    from transformers import CLIPTextConfig

    vocab, hidden = shapes[te + "embeddings.token_embedding.weight"]
    layers = 0
    while te + f"encoder.layers.{layers}.mlp.fc1.weight" in shapes:
        layers += 1
    cfg = CLIPTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=shapes[te + "encoder.layers.0.mlp.fc1.weight"][0],
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=shapes[te + "embeddings.position_embedding.weight"][0],
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    return cfg


def clip_tokenizer(pad_token="<|endoftext|>"):
    """transformers' CLIPTokenizer from the OpenAI BPE vocabulary open_clip_torch ships (no hub)."""
    import gzip

    from open_clip.tokenizer import SimpleTokenizer, default_bpe
    from transformers import CLIPTokenizer

    st = SimpleTokenizer()
    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = {("<|startoftext|>" if t == "<start_of_text>" else "<|endoftext|>" if t == "<end_of_text>" else t): i
             for t, i in st.encoder.items()}
    return CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges], model_max_length=77,
                         pad_token=pad_token)


def build_sd1(path, shapes, dtype, scheduler):
    """StableDiffusionPipeline over an ldm single-file SD 1.x checkpoint (see the module doc)."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.loaders import single_file_utils as sfu
    from transformers import CLIPTextModel
    import yaml

    original_config = sd1_original_config(shapes)
    checkpoint = sfu.load_single_file_checkpoint(path, local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        oc = os.path.join(tmp, "v1-inference.yaml")
        with open(oc, "w") as f:
            yaml.safe_dump(original_config, f)
        unet = UNet2DConditionModel.from_single_file(checkpoint, original_config=oc, torch_dtype=dtype,
                                                     local_files_only=True)
        vae = AutoencoderKL.from_single_file(checkpoint, original_config=oc, torch_dtype=dtype, local_files_only=True)
    te = CLIPTextModel(te_config(shapes))
    csd = sfu.convert_ldm_clip_checkpoint(checkpoint)
    own = te.state_dict()
    csd = {(k if k in own else k[len("text_model."):]): v for k, v in csd.items()}
    r = te.load_state_dict(csd, strict=False)
    if r.unexpected_keys or any(not k.endswith("position_ids") for k in r.missing_keys):
        fail(1, f"text encoder weights do not fit: unexpected {r.unexpected_keys[:3]}, missing {r.missing_keys[:3]}")
    te = te.to(dtype).eval()
    del checkpoint, csd
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=te, tokenizer=clip_tokenizer(), unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return pipe, unet, vae, [te]


SDXL_TE_L = "conditioner.embedders.0.transformer.text_model."
SDXL_TE_G = "conditioner.embedders.1.model."


def is_sdxl(shapes):
    return SDXL_TE_G + "token_embedding.weight" in shapes and UNET + "label_emb.0.0.weight" in shapes


def sdxl_unet_config(shapes):
    """diffusers UNet2DConditionModel config of an sgm SDXL UNet, from its shapes (heads of 64 channels)."""
    model_channels, in_channels = shapes[UNET + "input_blocks.0.0.weight"][:2]
    if in_channels != 4:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: the UNet takes {in_channels} input channels (inpainting); "
             "bench runs text-to-image")
    levels = [[]]  # per level: (out channels, transformer depth) of each res block
    k = 1
    while UNET + f"input_blocks.{k}.0.op.weight" in shapes or UNET + f"input_blocks.{k}.0.out_layers.3.weight" in shapes:
        if UNET + f"input_blocks.{k}.0.op.weight" in shapes:
            levels.append([])
        else:
            depth = 0
            while UNET + f"input_blocks.{k}.1.transformer_blocks.{depth}.attn2.to_k.weight" in shapes:
                depth += 1
            levels[-1].append((shapes[UNET + f"input_blocks.{k}.0.out_layers.3.weight"][0], depth))
        k += 1
    if not levels[0] or any(len(lv) != len(levels[0]) for lv in levels):
        fail(EXIT_NOT_COMPARABLE, f"not comparable: unexpected UNet layout in input_blocks ({levels})")
    widths = [lv[0][0] for lv in levels]
    depths = [lv[0][1] for lv in levels]
    context = next((v[1] for k, v in shapes.items() if k.startswith(UNET) and k.endswith("attn2.to_k.weight")), None)
    if context is None:
        fail(EXIT_NOT_COMPARABLE, "not comparable: the UNet has no cross-attention")
    adm_in = shapes[UNET + "label_emb.0.0.weight"][1]
    projection = shapes[SDXL_TE_G + "text_projection"][1]
    if adm_in <= projection or (adm_in - projection) % 6:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: ADM input {adm_in} is not the pooled {projection} + 6 size embeddings")
    return dict(
        sample_size=128,
        in_channels=in_channels,
        out_channels=shapes[UNET + "out.2.weight"][0],
        layers_per_block=len(levels[0]),
        block_out_channels=tuple(widths),
        down_block_types=tuple("CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depths),
        up_block_types=tuple("CrossAttnUpBlock2D" if d else "UpBlock2D" for d in reversed(depths)),
        transformer_layers_per_block=tuple(max(d, 1) for d in depths),
        attention_head_dim=tuple(max(w // 64, 1) for w in widths),
        cross_attention_dim=context,
        use_linear_projection=len(shapes[UNET + "middle_block.1.proj_in.weight"]) == 2,
        addition_embed_type="text_time",
        addition_time_embed_dim=(adm_in - projection) // 6,
        projection_class_embeddings_input_dim=adm_in,
        norm_num_groups=32,
    )


def vae_config(shapes, scaling_factor, VAE=VAE):
    """diffusers AutoencoderKL config of an ldm VAE (first_stage_model.*, or a bare autoencoder with
    VAE=""), from its shapes; decodes in the dtype it is given (force_upcast off)."""
    ch = shapes[VAE + "encoder.conv_in.weight"][0]
    mult = []
    while VAE + f"encoder.down.{len(mult)}.block.0.conv2.weight" in shapes:
        mult.append(shapes[VAE + f"encoder.down.{len(mult)}.block.0.conv2.weight"][0] // ch)
    blocks = 0
    while VAE + f"encoder.down.0.block.{blocks}.conv1.weight" in shapes:
        blocks += 1
    return dict(
        in_channels=shapes[VAE + "encoder.conv_in.weight"][1],
        out_channels=shapes[VAE + "decoder.conv_out.weight"][0],
        down_block_types=("DownEncoderBlock2D",) * len(mult),
        up_block_types=("UpDecoderBlock2D",) * len(mult),
        block_out_channels=tuple(ch * m for m in mult),
        layers_per_block=blocks,
        latent_channels=shapes[VAE + "decoder.conv_in.weight"][1],
        scaling_factor=scaling_factor,
        force_upcast=False,
    )


def openclip_te_config(shapes, prefix):
    """CLIPTextConfig of an OpenCLIP text tower (SDXL's bigG), from its shapes: heads of 64, GELU."""
    from transformers import CLIPTextConfig

    vocab, hidden = shapes[prefix + "token_embedding.weight"]
    layers = 0
    while prefix + f"transformer.resblocks.{layers}.mlp.c_fc.weight" in shapes:
        layers += 1
    return CLIPTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=shapes[prefix + "transformer.resblocks.0.mlp.c_fc.weight"][0],
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=shapes[prefix + "positional_embedding"][0],
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        projection_dim=shapes[prefix + "text_projection"][1],
    )


def load_strict(module, sd, what, assign=False):
    """Loads converted weights; every weight of `module` must be given and nothing else (position ids aside).
    With `assign` the module's parameters become the given tensors (no copy)."""
    own = module.state_dict()
    sd = {(k if k in own else k[len("text_model."):]): v for k, v in sd.items()}
    r = module.load_state_dict(sd, strict=False, assign=assign)
    if r.unexpected_keys or any(not k.endswith("position_ids") for k in r.missing_keys):
        fail(1, f"{what} weights do not fit: unexpected {r.unexpected_keys[:3]}, missing {r.missing_keys[:3]}")


def build_sdxl(path, shapes, dtype, scheduler):
    """StableDiffusionXLPipeline over an sgm single-file SDXL checkpoint (see the module doc)."""
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from diffusers.loaders import single_file_utils as sfu
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    ck = sfu.load_single_file_checkpoint(path, local_files_only=True)
    unet = UNet2DConditionModel(**sdxl_unet_config(shapes))
    load_strict(unet, sfu.convert_ldm_unet_checkpoint(ck, dict(unet.config)), "UNet")
    vae = AutoencoderKL(**vae_config(shapes, 0.13025))
    load_strict(vae, sfu.convert_ldm_vae_checkpoint(ck, dict(vae.config)), "VAE")
    te_l = CLIPTextModel(te_config(shapes, SDXL_TE_L))
    load_strict(te_l, sfu.convert_ldm_clip_checkpoint(ck), "CLIP-L")
    te_g = CLIPTextModelWithProjection(openclip_te_config(shapes, SDXL_TE_G))
    load_strict(te_g, sfu.convert_open_clip_checkpoint(te_g, ck, prefix=SDXL_TE_G), "OpenCLIP bigG")
    del ck
    unet, vae, te_l, te_g = (m.to(dtype).eval() for m in (unet, vae, te_l, te_g))
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=te_l, text_encoder_2=te_g, tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(pad_token="!"), unet=unet, scheduler=scheduler,
        force_zeros_for_empty_prompt=False, add_watermarker=False,
    )
    return pipe, unet, vae, [te_l, te_g]


# llama.cpp's names of a T5 encoder -> transformers' (sdhost's models/src/family/flux.rs LLAMA_T5).
LLAMA_T5 = [
    ("enc.", "encoder."), ("blk.", "block."), ("output_norm.", "final_layer_norm."),
    ("attn_q.", "layer.0.SelfAttention.q."), ("attn_k.", "layer.0.SelfAttention.k."),
    ("attn_v.", "layer.0.SelfAttention.v."), ("attn_o.", "layer.0.SelfAttention.o."),
    ("attn_norm.", "layer.0.layer_norm."), ("ffn_norm.", "layer.1.layer_norm."),
    ("ffn_up.", "layer.1.DenseReluDense.wi_1."), ("ffn_down.", "layer.1.DenseReluDense.wo."),
    ("ffn_gate.", "layer.1.DenseReluDense.wi_0."),
    ("attn_rel_b.", "layer.0.SelfAttention.relative_attention_bias."), ("token_embd.", "shared."),
]


def read_weights(path, dtype):
    """Every tensor of a .safetensors or .gguf file as torch tensors in `dtype` (GGUF blocks
    dequantized with the gguf package, one tensor at a time), and their shapes."""
    import torch

    out = {}
    if path.endswith(".gguf"):
        import gguf
        import numpy as np

        for t in gguf.GGUFReader(path).tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            out[t.name] = torch.from_numpy(np.array(a, dtype=np.float32).reshape(shape)).to(dtype)
    else:
        from safetensors.torch import load_file

        out = {k: v.to(dtype) for k, v in load_file(path).items()}
    return out, {k: list(v.shape) for k, v in out.items()}


def built(make, sd, what):
    """`make()` built without memory (on the meta device) whose parameters then become the given tensors
    themselves: a full-size transformer built in memory and loaded by copy would need its weights twice."""
    import torch

    with torch.device("meta"):
        m = make()
    load_strict(m, sd, what, assign=True)
    return m


def weights_fit(paths, dtype, device):
    """Refuses (not comparable) when the parts' weights in `dtype` exceed the host's available memory:
    they are all held there while the pipeline is built."""
    import torch

    n = 0
    for path in paths:
        if path.endswith(".gguf"):
            import gguf

            n += sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
        else:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    c = 1
                    for d in f.get_slice(k).get_shape():
                        c *= d
                    n += c
    need = n * torch.empty((), dtype=dtype).element_size()
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is not None and need > 0.9 * avail:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: the weights in {str(dtype).removeprefix('torch.')} need "
             f"{need / 2**30:.1f} GiB, this machine has {avail / 2**30:.1f} GiB available")


def count(shapes, fmt):
    n = 0
    while fmt.format(n) in shapes:
        n += 1
    return n


def need_parts(what, parts):
    """Refuses (not comparable) when one of the (flag, value) `parts` a family comes in is missing."""
    for flag, value in parts:
        if not value:
            fail(EXIT_NOT_COMPARABLE, f"not comparable: the diffusers peer takes {what} in parts ({flag} missing)")


def read_transformer(path, dtype):
    """A transformer file's tensors under their bare names (ComfyUI's `model.diffusion_model.` dropped), and
    their shapes."""
    sd, _ = read_weights(path, dtype)
    sd = {k.removeprefix("model.diffusion_model."): v for k, v in sd.items()}
    return sd, {k: list(v.shape) for k, v in sd.items()}


def flux_autoencoder(path, dtype):
    """FLUX.1's 16-channel autoencoder (ldm layout, no quant convs; scale 0.3611, shift 0.1159), which Z-Image
    shares."""
    from diffusers import AutoencoderKL
    from diffusers.loaders import single_file_utils as sfu

    ae, shapes = read_weights(path, dtype)
    vae = AutoencoderKL(**vae_config(shapes, 0.3611, VAE=""), shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False)
    load_strict(vae, sfu.convert_ldm_vae_checkpoint(ae, dict(vae.config)), "autoencoder")
    return vae


def flux_converter(inner_dim):
    """diffusers' own BFL->diffusers converter for a transformer `inner_dim` wide (the converter has
    FLUX.1's 3072 written in; the tiny fixtures are narrower)."""
    import inspect

    from diffusers.loaders import single_file_utils as sfu

    convert = sfu.convert_flux_transformer_checkpoint_to_diffusers
    src = inspect.getsource(convert)
    if inner_dim == 3072 or "inner_dim = 3072" not in src:
        return convert
    scope = dict(sfu.__dict__)
    exec(src.replace("inner_dim = 3072", f"inner_dim = {inner_dim}"), scope)
    return scope["convert_flux_transformer_checkpoint_to_diffusers"]


def build_flux(args, dtype):
    """FluxPipeline over FLUX.1 in parts, as `sdhost bench` gives them (--model the transformer in BFL's
    names, .safetensors or a GGUF; --t5xxl in transformers' or llama.cpp's names; --clip-l; --vae BFL's
    autoencoder), every weight in `dtype` (GGUF blocks dequantized at load: diffusers' bf16/f16 FLUX as
    people run it). Configs are read off the shapes as sdhost reads them: schnell without `guidance_in`
    (256 T5 tokens, no shift), dev with it (512 tokens, BFL's resolution-dependent shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

    need_parts("FLUX.1", [("--t5xxl", args.t5xxl), ("--clip-l", args.clip_l), ("--vae", args.vae),
                          ("--t5-tokenizer", args.t5_tokenizer)])
    weights_fit([args.model, args.t5xxl, args.clip_l, args.vae], dtype, args.device)
    sd, shapes = read_transformer(args.model, dtype)
    hidden, in_channels = shapes["img_in.weight"]
    d = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    dev = "guidance_in.in_layer.weight" in shapes
    dit = built(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=count(shapes, "double_blocks.{}.img_attn.qkv.weight"),
        num_single_layers=count(shapes, "single_blocks.{}.linear1.weight"), attention_head_dim=d,
        num_attention_heads=hidden // d, joint_attention_dim=shapes["txt_in.weight"][1],
        pooled_projection_dim=shapes["vector_in.in_layer.weight"][1], guidance_embeds=dev,
        axes_dims_rope=(d // 8, 7 * d // 16, 7 * d // 16),
    ), flux_converter(hidden)(sd), "FLUX.1 transformer")
    del sd
    t5, tshapes = read_weights(args.t5xxl, dtype)
    if any(k.startswith("enc.blk.") for k in t5):
        renamed = {}
        for k, v in t5.items():
            for a, b in LLAMA_T5:
                k = k.replace(a, b)
            renamed[k] = v
        t5 = renamed
        tshapes = {k: list(v.shape) for k, v in t5.items()}
    vocab, d_model = tshapes["shared.weight"]
    heads = tshapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"][1]
    t5.setdefault("encoder.embed_tokens.weight", t5["shared.weight"])
    te_t5 = built(lambda: T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=d_model, d_kv=tshapes["encoder.block.0.layer.0.SelfAttention.q.weight"][0] // heads,
        d_ff=tshapes["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"][0],
        num_layers=count(tshapes, "encoder.block.{}.layer.0.SelfAttention.q.weight"), num_heads=heads,
        relative_attention_num_buckets=tshapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"][0],
        relative_attention_max_distance=128, dropout_rate=0.0, layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
    )), t5, "T5")
    del t5
    clip, cshapes = read_weights(args.clip_l, dtype)
    te_l = CLIPTextModel(te_config(cshapes, "text_model."))
    load_strict(te_l, clip, "CLIP-L")
    vae = flux_autoencoder(args.vae, dtype)
    dit, vae, te_l, te_t5 = (m.to(dtype).eval() for m in (dit, vae, te_l, te_t5))
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=dev, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=sched, vae=vae, text_encoder=te_l, tokenizer=clip_tokenizer(),
                        text_encoder_2=te_t5, tokenizer_2=T5TokenizerFast(tokenizer_file=args.t5_tokenizer),
                        transformer=dit)
    call = dict(max_sequence_length=512 if dev else 256, guidance_scale=args.guidance if dev else 0.0)
    return pipe, dit, vae, [te_l, te_t5], call


# llama.cpp's names of a Qwen3 layer -> transformers' (sdhost's encoders/qwen3.rs reads the same).
QWEN_LAYER = [("attn_norm.", "input_layernorm."), ("attn_q_norm.", "self_attn.q_norm."),
              ("attn_k_norm.", "self_attn.k_norm."), ("attn_q.", "self_attn.q_proj."), ("attn_k.", "self_attn.k_proj."),
              ("attn_v.", "self_attn.v_proj."), ("attn_output.", "self_attn.o_proj."),
              ("ffn_norm.", "post_attention_layernorm."), ("ffn_gate.", "mlp.gate_proj."), ("ffn_up.", "mlp.up_proj."),
              ("ffn_down.", "mlp.down_proj.")]
QWEN_TOP = [("token_embd.", "model.embed_tokens."), ("output_norm.", "model.norm."), ("output.", "lm_head.")]
# Qwen's added tokens after its byte-level BPE vocabulary (sdhost's tokenizers/qwen.rs); the last six are
# not special.
QWEN_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
              "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
              "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
QWEN_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
# Qwen3's chat template as klein applies it (thinking off: an empty think block opens the answer).
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


def qwen_name(k):
    if k.startswith("blk."):
        _, n, rest = k.split(".", 2)
        for a, b in QWEN_LAYER:
            if rest.startswith(a):
                return f"model.layers.{n}.{b}{rest[len(a):]}"
    for a, b in QWEN_TOP:
        if k.startswith(a):
            return b + k[len(a):]
    return k


def qwen_tokenizer(merges_path, llm):
    """transformers' Qwen2TokenizerFast over Qwen's byte-level BPE, as sdhost tokenizes: a GGUF's own
    vocabulary (`tokenizer.ggml.tokens`/`merges`) where the text encoder carries one, else the merges sdhost
    ships laid out as Qwen's vocabulary is (the 256 byte symbols, each merge's result in order, the added
    tokens)."""
    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast

    tokens = merges = None
    if llm.endswith(".gguf"):
        import gguf

        fields = gguf.GGUFReader(llm).fields
        if "tokenizer.ggml.tokens" in fields and "tokenizer.ggml.merges" in fields:
            def strings(f):
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

            tokens = strings(fields["tokenizer.ggml.tokens"])
            merges = strings(fields["tokenizer.ggml.merges"])
    if tokens is None:
        merges = [m for m in open(merges_path, encoding="utf-8").read().split("\n") if m]
        bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        tokens = [chr(c) for c in cs] + [m.replace(" ", "", 1) for m in merges] + QWEN_ADDED
    added = [t for t in QWEN_ADDED if t in tokens]
    tok = Qwen2TokenizerFast(vocab={t: i for i, t in enumerate(tokens)},
                             merges=[tuple(m.split(" ")) for m in merges],
                             unk_token=None, bos_token=None, eos_token=None, pad_token=None)
    tok.add_tokens([AddedToken(t, special=t not in QWEN_NOT_SPECIAL, normalized=False) for t in added])
    for t in added:
        if tok.convert_tokens_to_ids(t) != tokens.index(t):
            fail(1, f"Qwen tokenizer: {t} is not at its id {tokens.index(t)}")
    tok.chat_template = QWEN_TEMPLATE
    tok.pad_token = "<|endoftext|>"
    return tok


def build_qwen3(path, dtype):
    """Qwen3ForCausalLM from `path` (transformers' or llama.cpp's names), built on the meta device and given
    the loaded tensors; and its layer count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    q, _ = read_weights(path, dtype)
    q = {qwen_name(k): v for k, v in q.items()}
    qs = {k: list(v.shape) for k, v in q.items()}
    vocab, hidden = qs["model.embed_tokens.weight"]
    head = qs["model.layers.0.self_attn.q_norm.weight"][0]
    layers = count(qs, "model.layers.{}.self_attn.q_proj.weight")
    q.setdefault("lm_head.weight", q["model.embed_tokens.weight"])
    qwen = built(lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=qs["model.layers.0.mlp.gate_proj.weight"][0],
        num_hidden_layers=layers, num_attention_heads=qs["model.layers.0.self_attn.q_proj.weight"][0] // head,
        num_key_value_heads=qs["model.layers.0.self_attn.k_proj.weight"][0] // head, head_dim=head,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False,
    )), q, "Qwen3")
    # The rotary table is a buffer no file holds: built here, off the meta device.
    qwen.model.rotary_emb = type(qwen.model.rotary_emb)(config=qwen.config)
    del q
    return qwen, layers


def build_klein(args, dtype):
    """Flux2KleinPipeline over FLUX.2 klein in parts (--model the transformer in BFL's names, --llm its Qwen3 in
    transformers' or llama.cpp's names, --vae BFL's autoencoder), every weight in `dtype`, GGUF blocks dequantized
    at load; configs off the shapes as sdhost reads them. Distilled (no CFG) at CFG 1, base with CFG above."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from diffusers.loaders import single_file_utils as sfu

    need_parts("FLUX.2 klein", [("--llm", args.llm), ("--vae", args.vae), ("--qwen-merges", args.qwen_merges)])
    weights_fit([args.model, args.llm, args.vae], dtype, args.device)
    qwen, layers = build_qwen3(args.llm, dtype)
    sd, shapes = read_transformer(args.model, dtype)
    width, in_channels = shapes["img_in.weight"]
    d = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    dit = built(lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=in_channels, num_layers=count(shapes, "double_blocks.{}.img_attn.qkv.weight"),
        num_single_layers=count(shapes, "single_blocks.{}.linear1.weight"), attention_head_dim=d,
        num_attention_heads=width // d, joint_attention_dim=shapes["txt_in.weight"][1],
        mlp_ratio=shapes["double_blocks.0.img_mlp.2.weight"][1] / width, axes_dims_rope=(d // 4,) * 4,
        rope_theta=2000, eps=1e-6, guidance_embeds="guidance_in.in_layer.weight" in shapes,
    ), sfu.convert_flux2_transformer_checkpoint_to_diffusers(sd), "FLUX.2 transformer")
    del sd
    ae, vs = read_weights(args.vae, dtype)
    for a, b in [("encoder.quant_conv.", "quant_conv."), ("decoder.post_quant_conv.", "post_quant_conv.")]:
        for k in [k for k in ae if k.startswith(a)]:
            ae[b + k[len(a):]] = ae.pop(k)
    cfg = vae_config({k: list(v.shape) for k, v in ae.items()}, 1.0, VAE="")
    cfg = {k: v for k, v in cfg.items() if k not in ("scaling_factor", "force_upcast")}
    vae = AutoencoderKLFlux2(**cfg)
    conv = sfu.convert_ldm_vae_checkpoint({k: v for k, v in ae.items() if not k.startswith("bn.")}, dict(vae.config))
    conv.update({k: v for k, v in ae.items() if k.startswith("bn.")})
    conv["bn.num_batches_tracked"] = conv.get("bn.num_batches_tracked", torch.tensor(0)).long()
    load_strict(vae, conv, "autoencoder")
    del ae
    dit, vae, qwen = (m.to(dtype).eval() for m in (dit, vae, qwen))
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                            base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                            max_image_seq_len=4096, time_shift_type="exponential")
    distilled = args.cfg_scale <= 1.0
    pipe = Flux2KleinPipeline(scheduler=sched, vae=vae, text_encoder=qwen, tokenizer=qwen_tokenizer(args.qwen_merges, args.llm),
                              transformer=dit, is_distilled=distilled)
    out_layers = tuple((k * layers + 3) // 4 for k in (1, 2, 3))
    call = dict(guidance_scale=args.cfg_scale, max_sequence_length=512, text_encoder_out_layers=out_layers)
    return pipe, dit, vae, [qwen], call


ZIMAGE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_zimage(args, dtype):
    """ZImagePipeline over Z-Image in parts (--model the transformer in Tongyi's original names, bare or under
    ComfyUI's prefix; --llm its Qwen3; --vae FLUX.1's autoencoder), every weight in `dtype`, GGUF blocks
    dequantized at load; configs off the shapes as sdhost reads them; rectified flow shifted by 3; CFG where
    sdhost's is above 1 (diffusers' guidance_scale is sdhost's CFG - 1)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from diffusers.loaders import single_file_utils as sfu

    need_parts("Z-Image", [("--llm", args.llm), ("--vae", args.vae), ("--qwen-merges", args.qwen_merges)])
    weights_fit([args.model, args.llm, args.vae], dtype, args.device)
    qwen, _ = build_qwen3(args.llm, dtype)
    sd, shapes = read_transformer(args.model, dtype)
    dim, patch_features = shapes["x_embedder.weight"]
    hd = shapes["layers.0.attention.q_norm.weight"][0]
    dit = built(lambda: ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=patch_features // 4, dim=dim,
        n_layers=count(shapes, "layers.{}.attention.qkv.weight"),
        n_refiner_layers=count(shapes, "noise_refiner.{}.attention.qkv.weight"), n_heads=dim // hd,
        n_kv_heads=dim // hd, norm_eps=1e-5, qk_norm=True, cap_feat_dim=shapes["cap_embedder.0.weight"][0],
        rope_theta=256.0, t_scale=1000.0, axes_dims=[hd // 4, 3 * hd // 8, 3 * hd // 8],
        axes_lens=[1024, 512, 512],
    ), sfu.convert_z_image_transformer_checkpoint_to_diffusers(sd), "Z-Image transformer")
    del sd
    vae = flux_autoencoder(args.vae, dtype)
    dit, vae, qwen = (m.to(dtype).eval() for m in (dit, vae, qwen))
    tok = qwen_tokenizer(args.qwen_merges, args.llm)
    tok.chat_template = ZIMAGE_TEMPLATE
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=sched, vae=vae, text_encoder=qwen.model, tokenizer=tok, transformer=dit)
    call = dict(guidance_scale=max(args.cfg_scale - 1.0, 0.0), max_sequence_length=512)
    if args.cfg_scale > 1.0:
        call["negative_prompt"] = args.negative_prompt
    return pipe, dit, vae, [qwen.model], call


def attention_name(model):
    """The attention processor's class (the model's own attention where it has no processors)."""
    try:
        procs = model.attn_processors
    except AttributeError:
        return f"{type(model).__name__}'s own"
    return type(procs[next(iter(procs))]).__name__ if procs else f"{type(model).__name__}'s own"


def peak_host_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Timer:
    """Sums the wall time of a module's forward calls and counts them."""

    def __init__(self, module, clock):
        self.total, self.calls, self.first_start, self.last_end = 0.0, 0, None, None
        self._t0 = None
        self._clock = clock
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_):
        self._t0 = self._clock()
        if self.first_start is None:
            self.first_start = self._t0

    def _post(self, *_):
        self.last_end = self._clock()
        self.total += self.last_end - self._t0
        self.calls += 1

    def reset(self):
        self.total, self.calls, self.first_start, self.last_end = 0.0, 0, None, None


def main():
    args = parse_args()
    klein = args.llm is not None and args.family == "flux2"
    zimage = args.llm is not None and args.family == "zimage"
    flux = args.t5xxl is not None or args.clip_l is not None or args.llm is not None
    if flux and (args.sampler, args.scheduler) != ("euler", "simple"):
        fail(EXIT_NOT_COMPARABLE, f"not comparable: diffusers' transformer pipelines sample with Euler on the simple "
             f"schedule, not {args.sampler} {args.scheduler}")
    if flux:
        args.sampler, args.scheduler = "euler", "discrete"  # FluxPipeline brings its own scheduler
    if args.sampler not in SAMPLERS:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: diffusers has no scheduler for sdhost's {args.sampler} "
             f"(mapped: {', '.join(SAMPLERS)})")
    if args.scheduler not in SCHEDULES:
        fail(EXIT_NOT_COMPARABLE, f"not comparable: diffusers has no {args.scheduler} schedule "
             f"(mapped: {', '.join(SCHEDULES)})")
    if not args.model.endswith(".safetensors") and not (flux and args.model.endswith(".gguf")):
        fail(EXIT_NOT_COMPARABLE, "not comparable: the diffusers peer reads single-file .safetensors checkpoints "
             "(and FLUX.1 transformers as .gguf)")
    try:
        import torch

        import diffusers
        import transformers
        from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
        from diffusers.loaders import single_file_utils as sfu
        from safetensors import safe_open
        from transformers import CLIPTextModel
        import yaml
        import open_clip  # noqa: F401  (the tokenizer's vocabulary)
    except ImportError as e:
        fail(EXIT_UNAVAILABLE, f"unavailable: {sys.executable}: {e}")

    import inspect

    if flux:
        try:
            import gguf  # noqa: F401  (GGUF files' blocks)
        except ImportError as e:
            fail(EXIT_UNAVAILABLE, f"unavailable: {sys.executable}: {e}")
    cls_name, extra = SAMPLERS[args.sampler]
    cls = getattr(diffusers, cls_name)
    kwarg = SCHEDULES[args.scheduler]
    if kwarg is not None:
        if kwarg not in inspect.signature(cls.__init__).parameters:
            fail(EXIT_NOT_COMPARABLE, f"not comparable: diffusers' {cls_name} has no {args.scheduler} schedule")
        extra = dict(extra, **{kwarg: True})
    sig = inspect.signature(cls.__init__).parameters
    sched_kwargs = {k: v for k, v in dict(SD1_SCHEDULE, **extra).items() if k in sig}

    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.device == "cpu" and args.dtype == "bf16" and cpu_flags() is not None \
            and not cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        # Without them PyTorch widens every bf16 operand to f32 in its kernels: on a Zen 3 its bf16
        # products ran at 14-21 GFLOP/s against 97-140 in f32, and SD 1.5 at 512² did not finish a
        # warm-up and a run in 14 minutes (f32: under 2). f32 is then this processor's best dtype.
        fail(EXIT_NOT_COMPARABLE, "not comparable: this processor has no native bf16 (neither AVX512-BF16 "
             "nor AMX): PyTorch emulates bf16 several times slower than its f32, the best dtype here")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            fail(EXIT_UNAVAILABLE, "unavailable: torch sees no CUDA device")

        def clock():
            # Kernels run asynchronously: a stage ends when the GPU is done with it.
            torch.cuda.synchronize()
            return time.perf_counter()
    else:
        clock = time.perf_counter

    shapes, call = {}, dict(negative_prompt=args.negative_prompt, guidance_scale=args.cfg_scale)
    if not flux:
        with safe_open(args.model, framework="pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    t = clock()
    if zimage:
        pipe, unet, vae, tes, call = build_zimage(args, dtype)
        cls_name = "FlowMatchEulerDiscreteScheduler"
    elif klein:
        pipe, unet, vae, tes, call = build_klein(args, dtype)
        cls_name = "FlowMatchEulerDiscreteScheduler"
    elif flux:
        pipe, unet, vae, tes, call = build_flux(args, dtype)
        cls_name = "FlowMatchEulerDiscreteScheduler"
    elif is_sdxl(shapes):
        pipe, unet, vae, tes = build_sdxl(args.model, shapes, dtype, cls(**sched_kwargs))
    else:
        pipe, unet, vae, tes = build_sd1(args.model, shapes, dtype, cls(**sched_kwargs))
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    load_s = clock() - t

    te_ts = [Timer(te, clock) for te in tes]
    unet_t = Timer(unet, clock)
    vae_time = {"total": 0.0, "start": None}
    decode = vae.decode

    def timed_decode(*a, **kw):
        t0 = clock()
        if vae_time["start"] is None:
            vae_time["start"] = t0
        out = decode(*a, **kw)
        vae_time["total"] += clock() - t0
        return out

    vae.decode = timed_decode

    def generate():
        for te_t in te_ts:
            te_t.reset()
        unet_t.reset()
        vae_time.update(total=0.0, start=None)
        g = torch.Generator().manual_seed(args.seed)
        t0 = clock()
        with torch.inference_mode():
            pipe(prompt=args.prompt, width=args.width, height=args.height, num_inference_steps=args.steps,
                 generator=g, output_type="np", **call)
        total = clock() - t0
        te_end = max((te_t.last_end for te_t in te_ts if te_t.last_end), default=None)
        sampling = (vae_time["start"] - te_end) if vae_time["start"] and te_end else None
        te_s = sum(te_t.total for te_t in te_ts)
        return {"total_s": total, "te_s": te_s, "sampling_s": sampling, "vae_s": vae_time["total"],
                "unet_calls": unet_t.calls}

    if args.no_warm_up:
        runs = [generate() for _ in range(args.runs)]
        first_run_s = runs[0]["total_s"]
    else:
        t = clock()
        generate()
        first_run_s = clock() - t
        runs = [generate() for _ in range(args.runs)]

    system = (f"diffusers {diffusers.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
              f"{args.dtype} weights and compute, "
              + ("StableDiffusionXLPipeline, its VAE decoding in that dtype (force_upcast off), " if is_sdxl(shapes) else "")
              + ((("ZImagePipeline" if zimage else "Flux2KleinPipeline" if klein else "FluxPipeline")
                  + ", GGUF blocks dequantized at load, ") if flux else "")
              + (f"{torch.cuda.get_device_name()}, " if args.device == "cuda" else f"{torch.get_num_threads()} threads, ")
              + f"{cls_name}, "
              f"attention {attention_name(unet)}")
    json.dump({"system": system, "load_s": load_s, "first_run_s": first_run_s, "runs": runs,
               "peak_host_bytes": peak_host_bytes()}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
