package main

import (
	"flag"
	"fmt"
	"strings"

	"distill/internal/cli"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "export", Summary: "export a trained student as an HF checkpoint (bf16, f32), NVFP4 (Model-Optimizer layout) or, for a LoRA run, its PEFT adapters", Run: runExport})
}

func runExport(args []string) error {
	fs := flag.NewFlagSet("student export", flag.ContinueOnError)
	ckpt := fs.String("checkpoint", "", "run directory (newest checkpoint) or checkpoint directory (required)")
	out := fs.String("out", "", "output directory (required; written whole through a temporary directory beside it and renamed into place, so not a mount point: give a directory inside one)")
	format := fs.String("format", "bf16", "bf16: HF BF16 checkpoint; f32: exact master weights; nvfp4: Model-Optimizer NVFP4 (needs a quant: nvfp4 run, or a LoRA run); a LoRA run's bf16, f32 and nvfp4 are the merged model, peft its adapters as PEFT saves them")
	force := fs.Bool("force", false, "replace --out if it is not empty: an earlier model directory, all its files removed (a cache, a run directory or dataset files are refused)")
	noTok := fs.Bool("no-tokenizer", false, "do not copy the run's tokenizer files and generation_config.json")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *ckpt == "" || *out == "" {
		return cli.Usagef("--checkpoint and --out are required")
	}
	if err := trainer.CheckExportFormat(*format); err != nil {
		return cli.Usage(err)
	}
	rep, err := trainer.Export(*ckpt, *out, trainer.ExportOptions{Format: *format, Force: *force, NoTokenizer: *noTok})
	if err != nil {
		return err
	}
	fmt.Printf("wrote %s (%s): %s\n", *out, *format, strings.Join(rep.Files, ", "))
	if rep.TokenizerFrom != "" {
		fmt.Printf("tokenizer files from %s\n", rep.TokenizerFrom)
	}
	if rep.ChatTemplate != "" {
		fmt.Printf("chat template: %s\n", rep.ChatTemplate)
	}
	if rep.GenerationConfig != "" {
		fmt.Printf("generation_config.json: %s\n", rep.GenerationConfig)
	}
	if rep.Note != "" {
		fmt.Printf("note: %s\n", rep.Note)
	}
	return nil
}
