package main

import (
	"fmt"
	"io"

	"distill/compute/device"
	"distill/infer"
	"distill/internal/cli"
	"distill/serve"
)

// printPlan writes the memory plan of the teacher cfg describes, on the
// GPUs of cfg.Devices (GPU 0 when none), as teacherd would run it: top-k
// up to --k-max (default min(vocab, 4096)), --max-draws draws (default
// 64), samples up to the token budget, which it checks; an error names a
// GPU the teacher does not fit.
func printPlan(w io.Writer, cfg serve.Config, pf planFlags) error {
	if cfg.Model == "" {
		return cli.Usagef("--plan needs --model DIR (its config.json; no weights are read)")
	}
	// The flags first: a bad --device-memory is a usage error whatever
	// the model.
	mem := int64(80 << 30)
	if !pf.memoryFromGPU {
		var err error
		if mem, err = cli.ParseBytes(pf.deviceMemory); err != nil {
			return cli.Usagef("--device-memory: %w", err)
		}
	}
	mc, err := infer.LoadConfigAt(cfg.Model)
	if err != nil {
		return err
	}
	// The daemon refuses a --k-max (or --k-default) above the vocabulary
	// at start; the plan printed one for it and exited 0, a plan of a
	// daemon that cannot run.
	if err := cfg.CheckK(mc.VocabSize); err != nil {
		return err
	}
	ords, err := device.ParseDevices(cfg.Devices)
	if err != nil {
		return err
	}
	if len(ords) == 0 {
		ords = []int{0}
	}
	if pf.memoryFromGPU {
		if name, total, err := device.GPUMemory(); err == nil {
			mem = total
			fmt.Fprintf(w, "device memory: %s's (--device-memory to plan for another)\n", name)
		} else {
			fmt.Fprintf(w, "device memory: 80 GiB, an H100's (no GPU visible: %v; --device-memory to plan for another)\n", err)
		}
	}
	budget := cfg.TokenBudget
	if budget == 0 {
		budget = infer.DefaultTokenBudget
	}
	k := cfg.KMax
	if k == 0 {
		k = min(mc.VocabSize, 4096)
	}
	draws := cfg.MaxDraws
	if draws == 0 {
		draws = serve.DefaultMaxDraws
	}
	p, err := infer.PlanTeacher(mc, infer.PlanOptions{Devices: ords, DeviceBytes: mem, Weights: infer.WeightFormat(cfg.Weights), K: k, Draws: draws,
		MaxLen: min(mc.MaxPositions, budget), Scratch: device.ForwardScratchTerms})
	if err != nil {
		return err
	}
	p.Print(w, budget)
	return p.Check(budget)
}
