package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"distill/compute/device"
	"distill/infer"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "plan", Summary: "a teacher's memory plan on paper: its layers over the GPUs, each GPU's bytes by term and the largest token budget, from config.json alone", Run: runPlan})
}

// planOut is where plan writes (tests replace it).
var planOut io.Writer = os.Stdout

func runPlan(args []string) error {
	fs := flag.NewFlagSet("cachectl plan", flag.ContinueOnError)
	cfgPath := fs.String("config", "", "the teacher's config.json, or its checkpoint directory (required; no weights are read)")
	devices := fs.String("devices", "", "the GPUs to spread the layers over: ordinals (0,1,2,3) or a count (4); default 1")
	gpus := fs.Int("gpus", 0, "a count of GPUs (the same as --devices N)")
	devMem := fs.String("device-memory", "80GiB", "each GPU's memory: a byte count with an optional unit, e.g. 80GiB (H100), 141GiB (H200)")
	weights := fs.String("weights", "bf16", "bf16, or fp8 (the layers' Linear weights in E4M3 with a fp32 scale per output channel, the embedding, norms, routers and LM head in BF16: teacherd --weights fp8, cachectl fill --teacher-weights fp8)")
	k := fs.Int("k", 64, "the largest top-k asked for (teacherd --k-max)")
	draws := fs.Int("draws", 0, "the most draws a position of sampled targets (teacherd --max-draws; cachectl fill --samples)")
	maxLen := fs.Int("max-len", 0, "the longest sample (default, and at most: max_position_embeddings, the longest teacherd serves)")
	budget := fs.Int("token-budget", 0, "check this token budget (teacherd --token-budget): an error names the GPU it does not fit (default: print the largest that fits)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *devices != "" && *gpus != 0 {
		return cli.Usagef("give --devices or --gpus, not both")
	}
	spec := *devices
	if *gpus != 0 {
		spec = fmt.Sprint(*gpus)
	}
	ords, err := device.PlanDevices(spec)
	if err != nil {
		return cli.Usage(err) // --devices' or --gpus' syntax
	}
	plan, err := teacherPlan(planOut, *cfgPath, ords, *devMem, *weights, *k, *draws, *maxLen, *budget)
	if err != nil {
		return err
	}
	plan.Print(planOut, *budget)
	return plan.Check(*budget)
}

// teacherPlan is the plan of a config.json (or its directory) on GPUs of
// devMem bytes each: cachectl plan's, and teacherd --plan's arithmetic.
// A note about the flags (a capped --max-len) goes to w.
func teacherPlan(w io.Writer, cfgPath string, ords []int, devMem, weights string, k, draws, maxLen, budget int) (infer.TeacherPlan, error) {
	if cfgPath == "" {
		return infer.TeacherPlan{}, cli.Usagef("--config is required: the teacher's config.json (or its checkpoint directory)")
	}
	mem, err := cli.ParseBytes(devMem)
	if err != nil {
		return infer.TeacherPlan{}, cli.Usagef("--device-memory: %w", err)
	}
	switch {
	case weights != string(infer.WeightsBF16) && weights != string(infer.WeightsFP8):
		// The plan refused it as a runtime error (exit 1), naming no flag.
		return infer.TeacherPlan{}, cli.Usagef("--weights %q: want bf16 or fp8", weights)
	case k < 1:
		return infer.TeacherPlan{}, cli.Usagef("--k %d: want >= 1", k)
	case maxLen < 0:
		return infer.TeacherPlan{}, cli.Usagef("--max-len %d: want >= 0 (0: max_position_embeddings)", maxLen)
	case draws < 0:
		return infer.TeacherPlan{}, cli.Usagef("--draws %d: want >= 0", draws)
	case budget < 0:
		return infer.TeacherPlan{}, cli.Usagef("--token-budget %d: want >= 0 (0: the largest that fits)", budget)
	}
	cfg, err := infer.LoadConfigAt(cfgPath)
	if err != nil {
		return infer.TeacherPlan{}, err
	}
	if k > cfg.VocabSize {
		// A position's top-k are distinct token ids: more than the
		// vocabulary was planned as given and exited 0, for a teacherd
		// --k-max (or a fill --k) that the teacher refuses at start.
		return infer.TeacherPlan{}, cli.Usagef("--k %d is more than the teacher's vocabulary (%d, the vocab_size of %s): a position's top-k ids are distinct ids of it, and teacherd refuses a --k-max above it: give at most --k %d",
			k, cfg.VocabSize, cfgPath, cfg.VocabSize)
	}
	if maxLen > cfg.MaxPositions {
		// teacherd caps a sample at max_position_embeddings (its --plan and
		// the daemon's limit alike): planning longer samples planned memory
		// for a forward the teacher never runs, and the two plans disagreed.
		fmt.Fprintf(w, "note: --max-len %d is more than max_position_embeddings %d of %s: planning samples of at most %d tokens, as teacherd does\n",
			maxLen, cfg.MaxPositions, cfgPath, cfg.MaxPositions)
		maxLen = cfg.MaxPositions
	}
	return infer.PlanTeacher(cfg, infer.PlanOptions{Devices: ords, DeviceBytes: mem, Weights: infer.WeightFormat(weights),
		K: k, Draws: draws, MaxLen: maxLen, Scratch: device.ForwardScratchTerms})
}
