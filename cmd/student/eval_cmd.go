package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"distill/cache"
	"distill/data/tokenizer"
	"distill/internal/cli"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "eval", Summary: "evaluate a student on cached samples: KD, CE, token accuracy, top-1 agreement", Run: runEval})
}

func runEval(args []string) error {
	fs := flag.NewFlagSet("student eval", flag.ContinueOnError)
	ckpt := fs.String("checkpoint", "", "run directory (newest checkpoint), checkpoint directory or HF checkpoint (required)")
	config := fs.String("config", "", "training config whose distill section, data.seq_len and data.eval_range are used (optional)")
	cacheDirs := fs.String("cache", "", "cache directories, comma-separated (default: the config's data.cache)")
	rng := fs.String("range", "", "sample range START:END (default: the config's data.eval_range, else every sample)")
	seqLen := fs.Int("seq-len", 0, "packed row length (default: the config's data.seq_len, else 2048)")
	tokFP := fs.String("tokenizer-fingerprint", "", "the student's tokenizer fingerprint (default: the checkpoint's, the config's)")
	tokDir := fs.String("tokenizer", "", "directory with the student's tokenizer.json (alternative to --tokenizer-fingerprint)")
	asJSON := fs.Bool("json", false, "print the metrics as JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *ckpt == "" {
		return fmt.Errorf("--checkpoint is required")
	}
	cfg := trainer.Defaults()
	if *config != "" {
		c, err := trainer.LoadConfig(*config, nil)
		if err != nil {
			return err
		}
		cfg = *c
	}
	s, st, err := trainer.LoadStudent(*ckpt)
	if err != nil {
		return err
	}
	dirs := cfg.Data.Cache
	if *cacheDirs != "" {
		dirs = strings.Split(*cacheDirs, ",")
	}
	if len(dirs) == 0 {
		return fmt.Errorf("--cache is required (or a --config with data.cache)")
	}
	rd, err := cache.OpenReader(dirs...)
	if err != nil {
		return err
	}
	m := rd.Manifest()
	fp := *tokFP
	switch {
	case fp != "":
	case *tokDir != "":
		tk, err := tokenizer.Load(*tokDir)
		if err != nil {
			return err
		}
		fp = tk.Fingerprint()
	case st != nil && st.TokenizerFingerprint != "":
		fp = st.TokenizerFingerprint
	case cfg.Model.TokenizerFingerprint != "":
		fp = cfg.Model.TokenizerFingerprint
	default:
		return fmt.Errorf("the student's tokenizer is unknown: give --tokenizer DIR or --tokenizer-fingerprint (a trainer checkpoint records it)")
	}
	if err := trainer.CheckCache(s.Cfg, fp, &m, strings.Join(dirs, ",")); err != nil {
		return err
	}
	r := cache.Range{Start: 0, End: m.Samples}
	if len(cfg.Data.EvalRange) == 2 {
		r = cache.Range{Start: cfg.Data.EvalRange[0], End: cfg.Data.EvalRange[1]}
	}
	if *rng != "" {
		a, b, ok := strings.Cut(*rng, ":")
		x, err1 := strconv.ParseInt(a, 10, 64)
		y, err2 := strconv.ParseInt(b, 10, 64)
		if !ok || err1 != nil || err2 != nil || x < 0 || y <= x || y > m.Samples {
			return fmt.Errorf("--range %q: want START:END with 0 <= START < END <= %d (the cache's samples)", *rng, m.Samples)
		}
		r = cache.Range{Start: x, End: y}
	}
	if *seqLen > 0 {
		cfg.Data.SeqLen = *seqLen
	}
	lo := cfg.LossOptions(float64(m.Temperature))
	if err := lo.Validate(); err != nil {
		return err
	}
	es, err := trainer.Evaluate(s, rd, r, cfg.Data.SeqLen, cfg.Data.Truncate, &lo)
	if err != nil {
		return err
	}
	if *asJSON {
		return json.NewEncoder(os.Stdout).Encode(es)
	}
	fmt.Printf("samples %v (%d), %d loss positions\nloss %.5f  kd(%s) %.5f  ce %.5f  token_accuracy %.4f  top1_agreement %.4f\n",
		r, es.Samples, es.Tokens, es.Loss, lo.KD, es.KD, es.CE, es.TokenAccuracy, es.Top1Agreement)
	return nil
}
