package main

import (
	"flag"
	"fmt"

	"distill/internal/cli"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "export", Summary: "export a trained student as an HF checkpoint (bf16) or NVFP4 (Model-Optimizer layout)", Run: runExport})
}

func runExport(args []string) error {
	fs := flag.NewFlagSet("student export", flag.ContinueOnError)
	ckpt := fs.String("checkpoint", "", "run directory (newest checkpoint) or checkpoint directory (required)")
	out := fs.String("out", "", "output directory (required)")
	format := fs.String("format", "bf16", "bf16: HF BF16 checkpoint; f32: exact master weights; nvfp4: Model-Optimizer NVFP4 (needs a quant: nvfp4 run)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *ckpt == "" || *out == "" {
		return fmt.Errorf("--checkpoint and --out are required")
	}
	s, _, err := trainer.LoadStudent(*ckpt)
	if err != nil {
		return err
	}
	switch *format {
	case "bf16", "f32":
		dt := map[string]string{"bf16": "BF16", "f32": "F32"}[*format]
		if err := s.WriteHF(*out, dt); err != nil {
			return err
		}
	case "nvfp4":
		if !s.QAD {
			return fmt.Errorf("--format nvfp4: %s was not trained with quant: nvfp4 (no calibrated amax); train with QAD or export bf16", *ckpt)
		}
		if err := s.WriteNVFP4(*out); err != nil {
			return err
		}
	default:
		return fmt.Errorf("--format %q: want bf16, f32 or nvfp4", *format)
	}
	fmt.Printf("wrote %s (%s)\n", *out, *format)
	return nil
}
