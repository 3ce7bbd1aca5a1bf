package main

import (
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"distill/compute"
	"distill/internal/cli"
	"distill/model"
	"distill/model/decoder"
	"distill/train"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "plan", Summary: "print a training config's device memory plan per recompute mode, for any device size (no cache, dataset or GPU needed)", Run: runPlan})
}

func runPlan(args []string) error {
	fs := flag.NewFlagSet("student plan", flag.ContinueOnError)
	config := fs.String("config", "", "YAML training config, `FILE`, as student train takes (required)")
	var sets multiFlag
	fs.Var(&sets, "set", "override a config key, key.path=value (repeatable), e.g. --set data.seq_len=8192")
	devMem := fs.String("device-memory", "80GiB", "the device's memory: a byte count with an optional unit (B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB), e.g. 80GiB, 141GiB")
	world := fs.Int("world-size", 1, "data-parallel ranks: each holds 1/N of AdamW's moments (train.zero 1), of the gradients too (2), of the fp32 weights too (3)")
	zero := fs.Int("zero", 0, "the ZeRO stage to plan over --world-size ranks: 0, 1, 2 or 3 (default: the config's train.zero)")
	acts := fs.String("activations", "bf16", "the device's activation dtype: bf16 (the CUDA backend's default) or f32 (DISTILL_CUDA_ACT=f32)")
	k := fs.Int("k", 0, "the teachers' top-k per position (the cache's k; several teachers: the sum of theirs; at most the vocabulary) (default: 64, or 0 when distill.kd_weight is 0)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *config == "" {
		return cli.Usagef("--config is required: the training config to plan")
	}
	if err := checkSets(sets); err != nil {
		return err
	}
	if *world < 1 {
		return cli.Usagef("--world-size %d: want >= 1", *world)
	}
	// --k and --zero default to the config's, which no number stands
	// for: their help said "(default -1)", the sentinel they had.
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if *zero > 3 || *zero < 0 {
		return cli.Usagef("--zero %d: want 0, 1, 2 or 3", *zero)
	}
	if given["zero"] && *zero > 0 && *world == 1 {
		// One process holds the whole state: the plan ignored --zero
		// without a word, as the trainer ignores train.zero.
		return cli.Usagef("--zero %d shards the optimizer state over data-parallel ranks: give their number too, --world-size N (N > 1)", *zero)
	}
	if *k < 0 {
		return cli.Usagef("--k %d: want >= 0", *k)
	}
	var act compute.DType
	switch *acts {
	case "bf16":
		act = compute.BF16
	case "f32":
		act = compute.F32
	default:
		return cli.Usagef("--activations %q: want bf16 or f32", *acts)
	}
	total, err := cli.ParseBytes(*devMem)
	if err != nil {
		return cli.Usagef("--device-memory: %w", err)
	}
	if r := train.DeviceReserve(total); total <= r {
		// It planned a negative budget ("-256.0 MiB for the run").
		return cli.Usagef("--device-memory %s: not more than the %s a device keeps in reserve: give the device's whole memory, e.g. 80GiB", *devMem, train.HumanBytes(r))
	}
	cfg, err := trainer.LoadConfig(*config, sets)
	if err != nil {
		return err
	}
	var mc *model.Config
	if cfg.Model.InitFrom != "" {
		// A student run's directory: its checkpoints hold the
		// config.json (the advice below, the example configs, was the
		// wrong way out).
		if err := trainer.CheckInitFrom(cfg.Model.InitFrom); err != nil {
			return err
		}
		if mc, err = model.LoadConfig(cfg.Model.InitFrom); err != nil {
			// The examples' init_from is a placeholder; the plan needs
			// only a config.json, which examples/model-configs holds.
			return fmt.Errorf("model.init_from: %w: the plan reads only the student's config.json: point model.init_from at a directory that holds it, e.g. --set model.init_from=examples/model-configs/qwen3-8b", err)
		}
	} else if mc, err = cfg.Model.Random.ModelConfig(); err != nil {
		return err
	}
	if *k > mc.VocabSize {
		// A position's top-k are distinct token ids, of one teacher or
		// the union of several: more than the vocabulary planned a loss
		// head for targets no cache can hold, without a word. The
		// student's vocabulary is the teachers' (the trainer checks the
		// caches against it), so it is the one to check against.
		from := "model.random.vocab_size"
		if cfg.Model.InitFrom != "" {
			from = "the vocab_size of model.init_from's config.json"
		}
		return cli.Usagef("--k %d is more than the vocabulary (%d, %s): a position's top-k ids are distinct ids of it, from one teacher or the union of several: give at most --k %d",
			*k, mc.VocabSize, from, mc.VocabSize)
	}
	if !given["k"] {
		*k = 64
		if cfg.Distill.KDWeight == 0 {
			*k = 0
		}
	}
	if given["zero"] {
		cfg.Train.ZeRO = *zero
	}
	return printPlan(stdout, cfg, mc, *k, act, *world, total)
}

// zeroNote says how the plan shards the optimizer state over world ranks
// (qad: NVFP4 QAD, whose stage 3 gathers the layers' weights in fp32;
// otherwise their GEMM weights in BF16).
func zeroNote(zero, world int, overlap, qad bool) string {
	grads, weights, ov := "one layer's", "two layers'", ""
	if overlap {
		grads, weights, ov = "two layers'", "three layers'", "; the collectives overlap the compute (train.overlap_comm)"
	}
	switch {
	case world <= 1 && zero > 0:
		// The config's train.zero, which one process ignores.
		return fmt.Sprintf(", one process (train.zero %d shards over data-parallel ranks: plan them with --world-size N)", zero)
	case world <= 1:
		return ""
	case zero == 2:
		whole := "every layer's whole BF16 GEMM weights (the norms, biases and routers: fp32)"
		if qad {
			whole = "every layer's whole fp32 weights (NVFP4 QAD reads them)"
		}
		return fmt.Sprintf(", %d ranks at ZeRO stage 2 (AdamW's moments and the gradients: 1/%d a rank, and %s and %s whole gradients%s)", world, world, whole, grads, ov)
	case zero == 3:
		gathered, parts := "BF16 GEMM weights (the norms, biases and routers: whole, fp32)", "the fp32 weights and the layers' GEMM weights in BF16"
		if qad {
			gathered, parts = "fp32 weights (NVFP4 QAD reads them)", "the fp32 weights"
		}
		return fmt.Sprintf(", %d ranks at ZeRO stage 3 (%s, AdamW's moments and the gradients: 1/%d a rank, and %s whole %s and %s whole gradients%s)", world, parts, world, weights, gathered, grads, ov)
	case zero >= 1:
		return fmt.Sprintf(", %d ranks at ZeRO stage %d (AdamW's moments: 1/%d a rank)", world, zero, world)
	}
	return fmt.Sprintf(", %d ranks at ZeRO stage 0 (every rank holds the whole optimizer state)", world)
}

// epHeld says what of the experts a ZeRO stage holds beyond a rank's
// share (train.ExpertParallelSaving).
func epHeld(zero int, overlap bool) string {
	switch zero {
	case 0:
		return "every expert's weights, gradients, moments and copies on every rank"
	case 1:
		return "every expert's weights, gradients and copies on every rank"
	case 2:
		if overlap {
			return "every expert's whole weights and two layers' whole gradients on every rank"
		}
		return "every expert's whole weights and a layer's whole gradients on every rank"
	}
	if overlap {
		return "three layers' experts' whole weights and two layers' whole gradients at a time"
	}
	return "two layers' experts' whole weights and one layer's whole gradients at a time"
}

// printPlan writes the plan of every recompute mode on a device of total
// bytes: the terms, then per mode the total, whether it fits, the
// longest row that fits and how many rows of data.seq_len one forward
// could hold, and train.recompute auto's choice.
func printPlan(w io.Writer, cfg *trainer.Config, mc *model.Config, k int, act compute.DType, world int, total int64) error {
	reserve := train.DeviceReserve(total)
	budget := total - reserve
	T := cfg.Data.SeqLen
	qad := cfg.Quant == "nvfp4"
	shape := func(r decoder.Recompute) train.PlanShape {
		sh := train.PlanShape{Model: mc, RowTokens: T, K: k, QAD: qad, Recompute: r, Activations: act, LoRA: cfg.TrainLoRA()}
		if world > 1 { // one process ignores train.zero, as the trainer does
			sh.Ranks, sh.ZeRO, sh.Overlap = world, cfg.Train.ZeRO, cfg.Train.Overlap()
		}
		return sh
	}
	fmt.Fprintf(w, "memory plan: %s student, %.1fM parameters (%s, hidden %d, vocab %d), rows of %d tokens (data.seq_len), teacher top-k %d, quant %s, %v activations%s\n",
		mc.Arch, float64(mc.Params())/1e6, layers(mc.Layers), mc.Hidden, mc.VocabSize, T, k, cfg.Quant, act, zeroNote(cfg.Train.ZeRO, world, cfg.Train.Overlap(), qad))
	if lc := cfg.TrainLoRA(); lc != nil {
		fmt.Fprintf(w, "LoRA: rank %d on %v, the base frozen (%v on the device%s)\n", lc.Rank, lc.Targets, act, map[bool]string{true: ", NVFP4-fake-quantized values"}[lc.NVFP4])
	}
	fmt.Fprintf(w, "device: %s, %s kept in reserve: %s for the run\n\n", train.HumanBytes(total), train.HumanBytes(reserve), train.HumanBytes(budget))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "term\tbytes\tper")
	base := train.PlanMemory(shape(decoder.RecomputeNone))
	for _, t := range base.Terms {
		switch {
		case t.Name == train.TermActivations:
			for _, r := range decoder.RecomputeModes {
				b := train.PlanMemory(shape(r)).Term(train.TermActivations)
				fmt.Fprintf(tw, "activations, recompute %s\t%s\trow (%.1f KiB a token)\n", r, train.HumanBytes(b), float64(b)/float64(T)/1024)
			}
		case t.Scratch:
			fmt.Fprintf(tw, "%s\t%s\trow (kernel scratch: the largest one counts)\n", t.Name, train.HumanBytes(t.Bytes))
		case t.PerRow:
			fmt.Fprintf(tw, "%s\t%s\trow\n", t.Name, train.HumanBytes(t.Bytes))
		default:
			fmt.Fprintf(tw, "%s\t%s\trun\n", t.Name, train.HumanBytes(t.Bytes))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "recompute\ttotal\tfits\tlongest row (tokens)\trows of %d per forward\n", T)
	auto := decoder.Recompute("")
	for _, r := range decoder.RecomputeModes {
		p := train.PlanMemory(shape(r))
		fits := p.Total() <= budget
		if fits && auto == "" {
			auto = r
		}
		n := train.LargestRow(shape(r), budget, 1<<24)
		longest := strconv.Itoa(n)
		if n > mc.MaxPositions {
			longest = fmt.Sprintf("%d (max_position_embeddings %d)", n, mc.MaxPositions)
		}
		yes := "no"
		if fits {
			yes = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\n", r, train.HumanBytes(p.Total()), yes, longest, n/T)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch full := train.PlanMemory(shape(decoder.RecomputeFull)); {
	case auto == "" && train.LargestRow(shape(decoder.RecomputeFull), budget, 1<<24) == 0:
		var run int64 // what the run holds whatever the row: parameters, gradients, moments, copies
		for _, t := range full.Terms {
			if !t.PerRow {
				run += t.Bytes
			}
		}
		fmt.Fprintf(w, "\ntrain.recompute auto: nothing fits, not even a row of one token: the parameters, gradients, AdamW moments and weight copies alone take %s of the %s; shard them over more GPUs or at a higher ZeRO stage (--world-size, --zero), or train a smaller student\n",
			train.HumanBytes(run), train.HumanBytes(budget))
	case auto == "":
		fmt.Fprintf(w, "\ntrain.recompute auto: nothing fits; lower data.seq_len to the longest row of full recompute, or use a larger device\n")
	default:
		fmt.Fprintf(w, "\ntrain.recompute auto picks: %s\n", auto)
	}
	if auto != "" {
		// The trainer's check before step 1 lets the loss head keep a row's
		// logits between its passes where they fit beside the mode's.
		if keep, fits := train.KeepLogitsFit(shape(auto), budget); fits {
			fmt.Fprintf(w, "the loss head keeps its logits between its passes on such a device (%s with recompute %s): one GEMM of three a vocabulary tile fewer\n", train.HumanBytes(keep), auto)
		} else {
			fmt.Fprintf(w, "the loss head recomputes its logits in its second pass on such a device (keeping them needs %s with recompute %s)\n", train.HumanBytes(keep), auto)
		}
	}
	if lc := cfg.TrainLoRA(); lc == nil {
		// A checkpoint holds the fp32 weights and both AdamW moments: 12
		// bytes a parameter (a LoRA run's, its adapters alone).
		ck := 12 * mc.Params()
		switch layout := cfg.Checkpoint.Layout; {
		case world > 1 && cfg.Train.ZeRO >= 1 && layout != "gathered":
			fmt.Fprintf(w, "checkpoints: %s each, sharded (checkpoint.layout auto or sharded): %s a rank's shard, written by every rank; no rank gathers the model\n",
				train.HumanBytes(ck), train.HumanBytes((ck+int64(world)-1)/int64(world)))
		default:
			fmt.Fprintf(w, "checkpoints: %s each, written by %s from its host memory\n", train.HumanBytes(ck), map[bool]string{true: "rank 0", false: "the process"}[world > 1])
		}
	}
	if ep := train.ExpertParallelSaving(shape(decoder.RecomputeFull)); ep > 0 {
		fmt.Fprintf(w, "expert parallelism (not built) over the %d ranks would save %s a GPU: each rank would hold 1/%d of every layer's experts whole and gather none (ZeRO %d holds %s); it would send the routed tokens to their experts' ranks instead\n",
			world, train.HumanBytes(ep), world, cfg.Train.ZeRO, epHeld(cfg.Train.ZeRO, cfg.Train.Overlap()))
	}
	if r := cfg.Train.Recompute; r != "auto" {
		if p := train.PlanMemory(shape(decoder.Recompute(r))); p.Total() > budget {
			fmt.Fprintf(w, "the config's train.recompute %s does not fit: `student train` refuses it before step 1\n", r)
		}
	}
	return nil
}
