package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"distill/compute/device"
	"distill/infer"
	"distill/internal/cli"
)

func init() {
	commands.Register(&cli.Command{Name: "score", Summary: "print a teacher's top-k next tokens for token ids (in-process)", Run: runScore})
}

func runScore(args []string) error {
	fs := flag.NewFlagSet("cachectl score", flag.ContinueOnError)
	modelDir := fs.String("model", "", "HF checkpoint directory (required)")
	ids := fs.String("ids", "", `token ids: "1,2,3"; several samples separated by ";" (required)`)
	k := fs.Int("k", 5, "top-k tokens to print per position")
	temp := fs.Float64("temperature", 1, "capture temperature")
	dev := fs.String("device", "auto", "compute device: auto (a GPU when one opens, else the CPU), cpu or cuda")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *modelDir == "" || *ids == "" {
		fs.Usage()
		return fmt.Errorf("--model and --ids are required")
	}
	var samples [][]int32
	for i, part := range strings.Split(*ids, ";") {
		var s []int32
		for _, f := range strings.Split(part, ",") {
			f = strings.TrimSpace(f)
			if f == "" {
				continue
			}
			v, err := strconv.ParseInt(f, 10, 32)
			if err != nil {
				return fmt.Errorf("--ids: sample %d: %q is not a token id", i, f)
			}
			s = append(s, int32(v))
		}
		samples = append(samples, s)
	}
	be, err := device.Open(*dev, device.Options{Purpose: device.Inference,
		Logf: func(format string, args ...any) { fmt.Fprintf(os.Stderr, "score: "+format+"\n", args...) }})
	if err != nil {
		return err
	}
	defer device.Close(be)
	m, err := infer.Load(*modelDir, be)
	if err != nil {
		return err
	}
	res, err := m.TopK(samples, infer.Options{K: *k, Temperature: float32(*temp)})
	if err != nil {
		return err
	}
	fmt.Printf("teacher %s (%s, %.2fM params, vocab %d), fingerprint %.12s, on %s\n", *modelDir, m.Cfg.Arch, float64(m.Cfg.Params())/1e6, m.Cfg.VocabSize, m.Fingerprint(), be.Name())
	for i, s := range samples {
		fmt.Printf("sample %d:\n", i)
		for p, tok := range s {
			var b strings.Builder
			for j := 0; j < *k; j++ {
				e := p**k + j
				fmt.Fprintf(&b, " %d:%.4f", res[i].IDs[e], math.Exp(float64(res[i].LogProbs[e])))
			}
			fmt.Printf("  pos %d token %d -> top-%d (id:prob)%s\n", p, tok, *k, b.String())
		}
	}
	return nil
}
