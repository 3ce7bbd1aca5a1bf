package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"text/tabwriter"

	"distill/compute/device"
	"distill/infer"
	"distill/internal/cli"
	"distill/model"
)

func init() {
	commands.Register(&cli.Command{Name: "plan", Summary: "a teacher's memory plan on paper: its layers over N GPUs and the largest token budget, from config.json alone", Run: runPlan})
}

// planOut is where plan writes (tests replace it).
var planOut io.Writer = os.Stdout

func runPlan(args []string) error {
	fs := flag.NewFlagSet("cachectl plan", flag.ContinueOnError)
	cfgPath := fs.String("config", "", "the teacher's config.json, or its checkpoint directory (required; no weights are read)")
	gpus := fs.Int("gpus", 1, "GPUs to spread the layers over (one GPU is what teacherd runs today)")
	devMem := fs.String("device-memory", "80GiB", "each GPU's memory: a byte count with an optional unit, e.g. 80GiB (H100), 141GiB (H200)")
	weights := fs.String("weights", "bf16", "bf16, or fp8 (E4M3 Linear weights with a scale per output channel: teacherd --weights fp8)")
	k := fs.Int("k", 64, "the largest top-k asked for (teacherd --k-max)")
	maxLen := fs.Int("max-len", 0, "the longest sample (default: max_position_embeddings)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *cfgPath == "" {
		return fmt.Errorf("--config is required: the teacher's config.json (or its checkpoint directory)")
	}
	mem, err := cli.ParseBytes(*devMem)
	if err != nil {
		return fmt.Errorf("--device-memory: %w", err)
	}
	if *k < 1 {
		return fmt.Errorf("--k %d: want >= 1", *k)
	}
	if *maxLen < 0 {
		return fmt.Errorf("--max-len %d: want >= 0 (0: max_position_embeddings)", *maxLen)
	}
	p := *cfgPath
	if st, err := os.Stat(p); err != nil || !st.IsDir() {
		p = filepath.Dir(p) // a config.json: model.LoadConfig reads DIR/config.json
		if filepath.Base(*cfgPath) != "config.json" {
			return fmt.Errorf("--config %s: want a config.json or the directory holding one", *cfgPath)
		}
	}
	cfg, err := model.LoadConfig(p)
	if err != nil {
		return err
	}
	plan, err := infer.PlanTeacher(cfg, infer.PlanOptions{GPUs: *gpus, DeviceBytes: mem, Weights: infer.WeightFormat(*weights),
		K: *k, MaxLen: *maxLen, Scratch: device.ForwardScratchBound})
	if err != nil {
		return err
	}
	printTeacherPlan(planOut, cfg, plan)
	return nil
}

// printTeacherPlan writes a plan: the model, each GPU's share and its
// largest forward, and the budget to run with (or what is short).
func printTeacherPlan(w io.Writer, cfg *model.Config, p infer.TeacherPlan) {
	o := p.Opts
	gib := func(b int64) string { return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30)) }
	fmt.Fprintf(w, "teacher plan: %s, %.2fB parameters (%d layers, hidden %d, vocab %d), %s weights, top-k up to %d, samples up to %d tokens\n",
		cfg.Arch, float64(cfg.Params())/1e9, cfg.Layers, cfg.Hidden, cfg.VocabSize, o.Weights, o.K, o.MaxLen)
	fmt.Fprintf(w, "%d GPU(s) of %s, %s of each kept in reserve\n", o.GPUs, gib(o.DeviceBytes), gib(p.Reserve))
	if o.Weights == infer.WeightsFP8 {
		fmt.Fprintln(w, "fp8: the layers' Linear weights in E4M3 with an fp32 scale per output channel (teacherd --weights fp8, cachectl fill --teacher-weights fp8); the embedding, norms, routers and LM head in BF16")
	}
	if o.GPUs > 1 {
		fmt.Fprintln(w, "several GPUs: a plan on paper only: teacherd runs a teacher on one GPU today (issue 29)")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tlayers\tweights\tlargest forward (tokens)\tits activations and scratch")
	for i, st := range p.Stages {
		what := fmt.Sprintf("%d-%d", st.FirstLayer, st.EndLayer-1)
		if st.Embed {
			what = "embedding, " + what
		}
		if st.Head {
			what += ", norm, LM head"
		}
		if st.Budget == 0 {
			left := o.DeviceBytes - p.Reserve - st.WeightBytes
			why := fmt.Sprintf("none: the weights exceed what the GPU offers by %s", gib(-left))
			if left >= 0 {
				why = fmt.Sprintf("none: the weights leave %s, one token needs %.1f MiB", gib(left), float64(st.BudgetBytes)/(1<<20))
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t\n", i, what, gib(st.WeightBytes), why)
			continue
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\n", i, what, gib(st.WeightBytes), st.Budget, gib(st.BudgetBytes))
	}
	tw.Flush()
	fmt.Fprintln(w)
	if p.Budget == 0 {
		fmt.Fprintf(w, "does not fit: a GPU has no room for one token beside its weights; plan more GPUs (--gpus), GPUs with more memory, or fp8 weights\n")
		return
	}
	fmt.Fprintf(w, "token budget: %d (teacherd --token-budget, cachectl fill --token-budget): the largest forward every GPU holds\n", p.Budget)
}
