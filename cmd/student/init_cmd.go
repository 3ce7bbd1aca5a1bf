package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"

	"distill/internal/cli"
	"distill/model"
)

func init() {
	commands.Register(&cli.Command{Name: "init", Summary: "write a random-initialized HF checkpoint directory", Run: runInit})
}

func runInit(args []string) error {
	fs := flag.NewFlagSet("student init", flag.ContinueOnError)
	arch := fs.String("arch", "qwen3", "architecture: llama, qwen2, qwen3, qwen3_moe")
	out := fs.String("out", "", "output checkpoint directory (required)")
	layers := fs.Int("layers", 0, "num_hidden_layers (0: the preset's)")
	hidden := fs.Int("hidden", 0, "hidden_size")
	heads := fs.Int("heads", 0, "num_attention_heads")
	kvHeads := fs.Int("kv-heads", 0, "num_key_value_heads")
	headDim := fs.Int("head-dim", 0, "head_dim")
	inter := fs.Int("intermediate", 0, "intermediate_size")
	vocab := fs.Int("vocab", 0, "vocab_size")
	maxPos := fs.Int("max-pos", 0, "max_position_embeddings")
	experts := fs.Int("experts", 0, "num_experts (qwen3_moe)")
	topk := fs.Int("experts-per-tok", 0, "num_experts_per_tok (qwen3_moe)")
	moeInter := fs.Int("moe-intermediate", 0, "moe_intermediate_size (qwen3_moe)")
	mlpOnly := fs.String("mlp-only-layers", "", "comma-separated dense layers (qwen3_moe)")
	tie := fs.String("tie", "", "tie_word_embeddings: true or false (default: the preset's)")
	bias := fs.String("attention-bias", "", "attention_bias: true or false (llama, qwen3)")
	seed := fs.Uint64("seed", 1, "random seed")
	std := fs.Float64("std", 0.02, "normal init std of matrices")
	perturb := fs.Bool("perturb", false, "random norm weights and biases too (for tests)")
	dtype := fs.String("dtype", "BF16", "stored dtype: BF16 or F32")
	force := fs.Bool("force", false, "replace --out if it is not empty (all its files are removed)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *out == "" {
		return fmt.Errorf("--out is required")
	}
	// A size flag given must be a size: 0 or a negative number is an
	// error, not "the preset's value" (leave the flag out for that).
	var bad []string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab", "max-pos", "experts", "experts-per-tok", "moe-intermediate":
			if v, _ := strconv.Atoi(f.Value.String()); v <= 0 {
				bad = append(bad, fmt.Sprintf("--%s %s", f.Name, f.Value))
			}
		case "std":
			if v, _ := strconv.ParseFloat(f.Value.String(), 64); !(v > 0) {
				bad = append(bad, fmt.Sprintf("--std %s", f.Value))
			}
		}
	})
	if len(bad) > 0 {
		return fmt.Errorf("%s: want positive numbers (leave a size flag out for the preset's value)", strings.Join(bad, ", "))
	}
	if dt := strings.ToUpper(*dtype); dt != "BF16" && dt != "F32" {
		return fmt.Errorf("--dtype %q: want BF16 or F32", *dtype)
	}
	cfg, err := model.Preset(model.Arch(*arch))
	if err != nil {
		return err
	}
	set := func(dst *int, v int) {
		if v > 0 {
			*dst = v
		}
	}
	set(&cfg.Layers, *layers)
	set(&cfg.Hidden, *hidden)
	set(&cfg.Heads, *heads)
	set(&cfg.KVHeads, *kvHeads)
	set(&cfg.HeadDim, *headDim)
	set(&cfg.Intermediate, *inter)
	set(&cfg.VocabSize, *vocab)
	set(&cfg.MaxPositions, *maxPos)
	set(&cfg.NumExperts, *experts)
	set(&cfg.ExpertsPerTok, *topk)
	set(&cfg.MoEIntermediate, *moeInter)
	if *mlpOnly != "" {
		cfg.MLPOnlyLayers = nil
		for _, f := range strings.Split(*mlpOnly, ",") {
			l, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil {
				return fmt.Errorf("--mlp-only-layers: %q is not a layer index", f)
			}
			cfg.MLPOnlyLayers = append(cfg.MLPOnlyLayers, l)
		}
	}
	for _, b := range []struct {
		flag, v string
		dst     *bool
	}{{"tie", *tie, &cfg.TieEmbeddings}, {"attention-bias", *bias, &cfg.AttentionBias}} {
		if b.v == "" {
			continue
		}
		v, err := strconv.ParseBool(b.v)
		if err != nil {
			return fmt.Errorf("--%s: %q is not true or false", b.flag, b.v)
		}
		*b.dst = v
	}
	if cfg.Arch != model.ArchQwen3 && cfg.Arch != model.ArchQwen3MoE && *headDim == 0 {
		cfg.HeadDim = cfg.Hidden / cfg.Heads
	}
	// Validate by round-tripping through the config.json parser, so init
	// never writes a checkpoint that Load would refuse.
	js, err := cfg.JSON()
	if err != nil {
		return err
	}
	if _, err := model.ParseConfig(js); err != nil {
		return err
	}
	if cfg.Arch == model.ArchQwen2 && cfg.HeadDim*cfg.Heads != cfg.Hidden {
		return fmt.Errorf("qwen2 derives head_dim = hidden/heads; --head-dim %d does not match %d/%d", cfg.HeadDim, cfg.Hidden, cfg.Heads)
	}
	if cfg.Hidden%cfg.Heads != 0 && cfg.Arch != model.ArchQwen3 && cfg.Arch != model.ArchQwen3MoE && *headDim == 0 {
		return fmt.Errorf("--hidden %d is not divisible by --heads %d", cfg.Hidden, cfg.Heads)
	}
	t := model.Init(cfg, model.InitOptions{Seed: *seed, Std: *std, Perturb: *perturb})
	err = model.WriteDir(*out, *force, func(tmp string) error {
		return model.WriteCheckpoint(tmp, cfg, t, strings.ToUpper(*dtype))
	})
	if err != nil {
		return err
	}
	fmt.Printf("wrote %s: %s, %d layers, hidden %d, vocab %d, %.2fM parameters\n", *out, cfg.Arch, cfg.Layers, cfg.Hidden, cfg.VocabSize, float64(cfg.Params())/1e6)
	return nil
}
