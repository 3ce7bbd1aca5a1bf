package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	"distill/internal/cli"
	"distill/internal/errkind"
	"distill/model"
)

func init() {
	commands.Register(&cli.Command{Name: "init", Summary: "write a random-initialized HF checkpoint directory", Run: runInit})
}

// initUsage is where init's -h and flag errors go, initOut its summary
// (tests capture them).
var (
	initUsage io.Writer = os.Stderr
	initOut   io.Writer = os.Stdout
)

// layers is "1 layer" or "N layers" (it said "1 layers").
func layers(n int) string {
	if n == 1 {
		return "1 layer"
	}
	return fmt.Sprintf("%d layers", n)
}

func runInit(args []string) error {
	fs := flag.NewFlagSet("student init", flag.ContinueOnError)
	fs.SetOutput(initUsage)
	f := newInitFlags(fs)
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if err := f.check(fs); err != nil {
		return err
	}
	// The config is the flags' alone (over the preset): what is wrong
	// with it is a usage error (exit 2).
	cfg, err := f.config()
	if err != nil {
		return cli.Usage(err)
	}
	given := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	if err := checkInitConfig(cfg, *f.headDim, given); err != nil {
		return cli.Usage(err)
	}
	if err := checkOutNotInModel(*f.out); err != nil {
		return err
	}
	if err := checkInitFits(cfg, strings.ToUpper(*f.dtype), *f.out); err != nil {
		return err
	}
	t := model.Init(cfg, model.InitOptions{Seed: *f.seed, Std: *f.std, Perturb: *f.perturb})
	err = model.WriteDir(*f.out, *f.force, func(tmp string) error {
		return model.WriteCheckpoint(tmp, cfg, t, strings.ToUpper(*f.dtype))
	})
	if err != nil {
		return err
	}
	printInitSummary(*f.out, cfg)
	return nil
}

// initFlags are student init's flags.
type initFlags struct {
	arch, out, mlpOnly, normTopK, routerLogits, auxCoef, tie, bias, dtype *string
	layers, hidden, heads, kvHeads, headDim, inter, vocab, maxPos         *int
	experts, topk, moeInter, sparseStep                                   *int
	seed                                                                  *uint64
	std                                                                   *float64
	perturb, force                                                        *bool
}

func newInitFlags(fs *flag.FlagSet) *initFlags {
	return &initFlags{
		arch:         fs.String("arch", "qwen3", "architecture: llama, qwen2, qwen3, qwen3_moe"),
		out:          fs.String("out", "", "output checkpoint directory (required)"),
		layers:       fs.Int("layers", 0, "num_hidden_layers (default: the preset's, as for every size flag)"),
		hidden:       fs.Int("hidden", 0, "hidden_size"),
		heads:        fs.Int("heads", 0, "num_attention_heads"),
		kvHeads:      fs.Int("kv-heads", 0, "num_key_value_heads"),
		headDim:      fs.Int("head-dim", 0, "head_dim"),
		inter:        fs.Int("intermediate", 0, "intermediate_size"),
		vocab:        fs.Int("vocab", 0, "vocab_size"),
		maxPos:       fs.Int("max-pos", 0, "max_position_embeddings"),
		experts:      fs.Int("experts", 0, "num_experts (qwen3_moe)"),
		topk:         fs.Int("experts-per-tok", 0, "num_experts_per_tok (qwen3_moe)"),
		moeInter:     fs.Int("moe-intermediate", 0, "moe_intermediate_size (qwen3_moe)"),
		mlpOnly:      fs.String("mlp-only-layers", "", "comma-separated dense layers (qwen3_moe; \"none\": every layer sparse)"),
		sparseStep:   fs.Int("decoder-sparse-step", 0, "decoder_sparse_step: every n-th layer is sparse (qwen3_moe)"),
		normTopK:     fs.String("norm-topk-prob", "", "norm_topk_prob: true or false (qwen3_moe; default: the preset's, true)"),
		routerLogits: fs.String("output-router-logits", "", "output_router_logits: true adds the load-balancing loss in training (qwen3_moe; default false)"),
		auxCoef:      fs.String("router-aux-loss-coef", "", "router_aux_loss_coef, a number >= 0 (qwen3_moe; default 0.001)"),
		tie:          fs.String("tie", "", "tie_word_embeddings: true or false (default: the preset's)"),
		bias:         fs.String("attention-bias", "", "attention_bias: true or false (llama, qwen3, qwen3_moe; qwen2 always has q/k/v biases)"),
		seed:         fs.Uint64("seed", 1, "random seed"),
		std:          fs.Float64("std", 0.02, "normal init std of matrices"),
		perturb:      fs.Bool("perturb", false, "random norm weights and biases too (for tests)"),
		dtype:        fs.String("dtype", "BF16", "stored dtype: BF16 or F32"),
		force:        fs.Bool("force", false, "replace --out if it is not empty: an earlier model directory, all its files removed (a cache, a run directory or dataset files are refused)"),
	}
}

// check refuses what the flags alone get wrong: extra arguments, no --out,
// sizes that are not positive, MoE flags on a dense architecture, the dtype.
func (f *initFlags) check(fs *flag.FlagSet) error {
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *f.out == "" {
		return cli.Usagef("--out is required")
	}
	// A size flag given must be a size: 0 or a negative number is an
	// error, not "the preset's value" (leave the flag out for that).
	var bad []string
	fs.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab", "max-pos", "experts", "experts-per-tok", "moe-intermediate", "decoder-sparse-step":
			if v, _ := strconv.Atoi(fl.Value.String()); v <= 0 {
				bad = append(bad, fmt.Sprintf("--%s %s", fl.Name, fl.Value))
			}
		}
	})
	if len(bad) > 0 {
		return cli.Usagef("%s: want positive numbers (leave a size flag out for the preset's value)", strings.Join(bad, ", "))
	}
	// Not a size: the hint above would be wrong for it.
	if v := *f.std; !(v > 0) || math.IsInf(v, 0) {
		return cli.Usagef("--std %g: want a positive standard deviation (default 0.02)", v)
	}
	// Qwen2 always has q/k/v biases (its config.json has no
	// attention_bias key): --attention-bias false wrote a checkpoint
	// without them, which every loader, ours included, refuses.
	if *f.arch == string(model.ArchQwen2) && *f.bias != "" {
		if v, err := strconv.ParseBool(*f.bias); err == nil && !v {
			return cli.Usagef("--attention-bias false: qwen2 always has q/k/v biases (its config.json has no attention_bias key); leave the flag out, or use --arch llama or qwen3")
		}
	}
	if *f.arch != string(model.ArchQwen3MoE) {
		var moeFlags []string
		fs.Visit(func(fl *flag.Flag) {
			switch fl.Name {
			case "experts", "experts-per-tok", "moe-intermediate", "mlp-only-layers", "decoder-sparse-step", "norm-topk-prob", "output-router-logits", "router-aux-loss-coef":
				moeFlags = append(moeFlags, "--"+fl.Name)
			}
		})
		if len(moeFlags) > 0 {
			return cli.Usagef("%s: MoE flags need --arch qwen3_moe (got --arch %s)", strings.Join(moeFlags, ", "), *f.arch)
		}
	}
	if dt := strings.ToUpper(*f.dtype); dt != "BF16" && dt != "F32" {
		return cli.Usagef("--dtype %q: want BF16 or F32", *f.dtype)
	}
	return nil
}

// config is the architecture's preset with the flags given applied.
func (f *initFlags) config() (*model.Config, error) {
	cfg, err := model.Preset(model.Arch(*f.arch))
	if err != nil {
		return nil, err
	}
	set := func(dst *int, v int) {
		if v > 0 {
			*dst = v
		}
	}
	set(&cfg.Layers, *f.layers)
	set(&cfg.Hidden, *f.hidden)
	set(&cfg.Heads, *f.heads)
	set(&cfg.KVHeads, *f.kvHeads)
	set(&cfg.HeadDim, *f.headDim)
	set(&cfg.Intermediate, *f.inter)
	set(&cfg.VocabSize, *f.vocab)
	set(&cfg.MaxPositions, *f.maxPos)
	set(&cfg.NumExperts, *f.experts)
	set(&cfg.ExpertsPerTok, *f.topk)
	set(&cfg.MoEIntermediate, *f.moeInter)
	set(&cfg.DecoderSparseStep, *f.sparseStep)
	if *f.auxCoef != "" {
		coef, err := strconv.ParseFloat(*f.auxCoef, 64)
		if err != nil || !(coef >= 0) {
			return nil, fmt.Errorf("--router-aux-loss-coef %s: want a number >= 0", *f.auxCoef)
		}
		cfg.RouterAuxLossCoef = coef
	}
	if *f.mlpOnly == "none" {
		cfg.MLPOnlyLayers = nil
	} else if *f.mlpOnly != "" {
		cfg.MLPOnlyLayers = nil
		for _, s := range strings.Split(*f.mlpOnly, ",") {
			l, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				return nil, fmt.Errorf("--mlp-only-layers: %q is not a layer index", s)
			}
			cfg.MLPOnlyLayers = append(cfg.MLPOnlyLayers, l)
		}
	}
	for _, b := range []struct {
		flag, v string
		dst     *bool
	}{{"tie", *f.tie, &cfg.TieEmbeddings}, {"attention-bias", *f.bias, &cfg.AttentionBias},
		{"norm-topk-prob", *f.normTopK, &cfg.NormTopKProb}, {"output-router-logits", *f.routerLogits, &cfg.OutputRouterLogits}} {
		if b.v == "" {
			continue
		}
		v, err := strconv.ParseBool(b.v)
		if err != nil {
			return nil, fmt.Errorf("--%s: %q is not true or false", b.flag, b.v)
		}
		*b.dst = v
	}
	if cfg.Arch != model.ArchQwen3 && cfg.Arch != model.ArchQwen3MoE && *f.headDim == 0 {
		cfg.HeadDim = cfg.Hidden / cfg.Heads
	}
	return cfg, nil
}

// checkInitConfig validates cfg by round-tripping it through the
// config.json parser, so init never writes a checkpoint that Load would
// refuse, and checks what the architectures derive from hidden and heads
// (headDim: the --head-dim flag, 0 when left out; given: the flags
// given). The head counts are checked first, naming the flags: the
// parser names config.json's keys, and a value the preset set, which
// the user never typed ("num_attention_heads 3 is not a multiple of
// num_key_value_heads 2" for --heads 3; "head_dim 7 must be positive and
// even" for --arch llama --hidden 30).
func checkInitConfig(cfg *model.Config, headDim int, given map[string]bool) error {
	flagVal := func(name string, v int) string {
		if given[name] {
			return fmt.Sprintf("--%s %d", name, v)
		}
		return fmt.Sprintf("--%s %d (the preset's)", name, v)
	}
	if cfg.Heads > 0 && cfg.KVHeads > 0 && cfg.Heads%cfg.KVHeads != 0 {
		return fmt.Errorf("%s is not a multiple of %s: each key/value head serves the same number of query heads; give --kv-heads a divisor of %d (e.g. --kv-heads 1), or --heads a multiple of %d",
			flagVal("heads", cfg.Heads), flagVal("kv-heads", cfg.KVHeads), cfg.Heads, cfg.KVHeads)
	}
	if cfg.Heads > 0 && cfg.Hidden%cfg.Heads != 0 && cfg.Arch != model.ArchQwen3 && cfg.Arch != model.ArchQwen3MoE && headDim == 0 {
		return fmt.Errorf("%s is not divisible by %s: %s derives head_dim = hidden/heads; give sizes that divide", flagVal("hidden", cfg.Hidden), flagVal("heads", cfg.Heads), cfg.Arch)
	}
	// A head_dim the user did not type is hidden/heads (llama, qwen2):
	// name the flags it came from, not a --head-dim never given.
	if (cfg.HeadDim <= 0 || cfg.HeadDim%2 != 0) && headDim == 0 && cfg.Arch != model.ArchQwen3 && cfg.Arch != model.ArchQwen3MoE {
		return fmt.Errorf("%s / %s gives head_dim %d, which must be positive and even (RoPE rotates pairs): %s derives head_dim = hidden/heads; give --hidden and --heads whose quotient is even, or --head-dim", flagVal("hidden", cfg.Hidden), flagVal("heads", cfg.Heads), cfg.HeadDim, cfg.Arch)
	}
	js, err := cfg.JSON()
	if err != nil {
		return err
	}
	if _, err := model.ParseConfig(js); err != nil {
		return initFlagError(err)
	}
	if cfg.NumExperts > 0 && !anySparse(cfg) {
		return fmt.Errorf("qwen3_moe with no sparse layer: with --decoder-sparse-step %d and --mlp-only-layers %s, none of the %s has experts (a dense model with unused expert weights); give a --decoder-sparse-step of at most %d, or fewer --mlp-only-layers",
			cfg.DecoderSparseStep, mlpOnlyText(cfg.MLPOnlyLayers), layers(cfg.Layers), cfg.Layers)
	}
	if cfg.Arch == model.ArchQwen2 && cfg.HeadDim*cfg.Heads != cfg.Hidden {
		return fmt.Errorf("qwen2 derives head_dim = hidden/heads; --head-dim %d does not match %d/%d", cfg.HeadDim, cfg.Hidden, cfg.Heads)
	}
	return nil
}

// initFlagNames maps the config.json keys the parser's errors name to the
// init flags that set them.
var initFlagNames = map[string]string{
	"vocab_size": "--vocab", "hidden_size": "--hidden", "num_hidden_layers": "--layers",
	"num_attention_heads": "--heads", "num_key_value_heads": "--kv-heads", "head_dim": "--head-dim",
	"intermediate_size": "--intermediate", "max_position_embeddings": "--max-pos",
	"num_experts": "--experts", "num_experts_per_tok": "--experts-per-tok", "moe_intermediate_size": "--moe-intermediate",
	"decoder_sparse_step": "--decoder-sparse-step", "mlp_only_layers": "--mlp-only-layers",
	"router_aux_loss_coef": "--router-aux-loss-coef",
}

var configKeyRE = regexp.MustCompile(`\b[a-z][a-z_]*[a-z]\b`)

// initFlagError is a config.json parser error in init's terms: the user
// typed flags, not config.json keys ("head_dim 7 must be positive and
// even" for --head-dim 7), so each key with a flag is named by its flag;
// the rest of the message is kept. The error chain is kept too.
func initFlagError(err error) error {
	msg := configKeyRE.ReplaceAllStringFunc(err.Error(), func(w string) string {
		if f, ok := initFlagNames[w]; ok {
			return f
		}
		return w
	})
	return errkind.Reword(model.ErrConfig, err, "%s", msg)
}

// anySparse reports whether some layer of cfg has the MoE block.
func anySparse(cfg *model.Config) bool {
	for i := 0; i < cfg.Layers; i++ {
		if cfg.IsMoE(i) {
			return true
		}
	}
	return false
}

// mlpOnlyText is --mlp-only-layers as the flag takes it ("none" for none).
func mlpOnlyText(ls []int) string {
	if len(ls) == 0 {
		return "none"
	}
	s := make([]string, len(ls))
	for i, l := range ls {
		s[i] = strconv.Itoa(l)
	}
	return strings.Join(s, ",")
}

// printInitSummary says what init wrote.
func printInitSummary(out string, cfg *model.Config) {
	fmt.Fprintf(initOut, "wrote %s: %s, %s, hidden %d, vocab %d, %.2fM parameters\n", out, cfg.Arch, layers(cfg.Layers), cfg.Hidden, cfg.VocabSize, float64(cfg.Params())/1e6)
	if cfg.NumExperts > 0 {
		var sparse []string
		for i := 0; i < cfg.Layers; i++ {
			if cfg.IsMoE(i) {
				sparse = append(sparse, strconv.Itoa(i))
			}
		}
		fmt.Fprintf(initOut, "  %d experts, top-%d, moe_intermediate_size %d; sparse layers [%s]; load-balancing loss %s\n", cfg.NumExperts, cfg.ExpertsPerTok,
			cfg.MoEIntermediate, strings.Join(sparse, ","), map[bool]string{true: fmt.Sprintf("on (coef %g)", cfg.RouterAuxLossCoef), false: "off (--output-router-logits true turns it on)"}[cfg.OutputRouterLogits])
	}
}

// hostMemAvailable is the memory a new allocation can take and what
// bounds it (availableMemory of the machine's /proc and /sys; ok false
// where neither can be read), diskFree the bytes an unprivileged writer
// has free on the file system holding path. Variables, so that a test
// stands for a small machine.
var (
	hostMemAvailable = func() (memAvail, bool) { return availableMemory("/") }
	diskFree         = func(path string) (int64, bool) {
		var st syscall.Statfs_t
		if syscall.Statfs(path, &st) != nil {
			return 0, false
		}
		return int64(st.Bavail) * st.Bsize, true
	}
)

// checkOutNotInModel refuses an --out inside a model directory (one that
// holds an HF config.json or model.safetensors): --out m1/sub wrote a
// model nested in m1, whose files every tool that reads m1 then walks
// past or mixes up, and which --force on m1 later removes with it. A
// config.json that is not a model's (a project's, above --out) does not
// make its directory a model's.
func checkOutNotInModel(out string) error {
	for d := filepath.Clean(out); ; {
		parent := filepath.Dir(d)
		if parent == d {
			return nil
		}
		d = parent
		for _, name := range []string{"config.json", "model.safetensors"} {
			if model.IsModelFile(filepath.Join(d, name)) {
				named := d
				if abs, err := filepath.Abs(d); err == nil && d == "." {
					named = abs
				}
				sibling := filepath.Join(filepath.Dir(named), filepath.Base(named)+"-"+filepath.Base(filepath.Clean(out)))
				return cli.Usagef("--out %s is inside %s, a model directory (it holds %s): a model nested in another's directory gets mixed up with it; choose a directory beside it, e.g. --out %s", out, named, name, sibling)
			}
		}
	}
}

// checkInitFits refuses, before anything is allocated or written, a
// checkpoint this machine cannot make: model.Init holds every tensor in
// fp32, the writer one tensor more in fp32 and in the stored dtype, and
// the file takes each parameter's stored bytes. A mistyped size (--vocab
// 1519360000) ended in Go's "fatal error: out of memory" and its stack
// trace. The sizes are summed in float64: their product may overflow an
// int.
func checkInitFits(cfg *model.Config, dtype, out string) error {
	var params, largest float64
	for _, t := range cfg.Tensors() {
		n := 1.0
		for _, d := range t.Shape {
			n *= float64(d)
		}
		params += n
		largest = max(largest, n)
	}
	stored := 2.0
	if dtype == "F32" {
		stored = 4
	}
	count := fmt.Sprintf("%.2fM", params/1e6)
	if params >= 1e9 {
		count = fmt.Sprintf("%.2fB", params/1e9)
	}
	what := fmt.Sprintf("%s of %s parameters (%s, hidden %d, intermediate %d, vocab %d)", cfg.Arch, count, layers(cfg.Layers), cfg.Hidden, cfg.Intermediate, cfg.VocabSize)
	const check = "check the size flags (--vocab, --hidden, --intermediate, --layers; --experts, --moe-intermediate)"
	gib := gibString
	if avail, ok := hostMemAvailable(); ok {
		if need := 4*params + (4+stored)*largest; need > float64(avail.bytes) {
			return fmt.Errorf("a %s: initializing it takes %s of memory, and %s: %s", what, gib(need), avail, check)
		}
	}
	// The nearest directory that exists: WriteDir makes the others.
	dir := filepath.Dir(filepath.Clean(out))
	for {
		if fi, err := os.Stat(dir); err == nil && fi.IsDir() {
			break
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return nil
		}
		dir = parent
	}
	if free, ok := diskFree(dir); ok {
		if need := stored * params; need > float64(free) {
			return fmt.Errorf("a %s: its %s checkpoint takes %s, and the file system of %s has %s free: %s, or choose another --out", what, dtype, gib(need), dir, gib(float64(free)), check)
		}
	}
	return nil
}
