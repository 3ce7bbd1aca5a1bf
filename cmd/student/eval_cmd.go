package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"distill/cache"
	"distill/compute/device"
	"distill/data/tokenizer"
	"distill/internal/cli"
	"distill/internal/errkind"
	"distill/train"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "eval", Summary: "evaluate a student on cached samples: KD, CE, token accuracy, top-1 agreement", Run: runEval})
}

func runEval(args []string) error {
	fs := flag.NewFlagSet("student eval", flag.ContinueOnError)
	ckpt := fs.String("checkpoint", "", "run directory (newest checkpoint), checkpoint directory or HF checkpoint (required)")
	config := fs.String("config", "", "config whose distill section, data.cache (or data.dataset), data.seq_len and data.eval_range are used: a training config, or one with only distill: (and data:) (optional)")
	cacheDirs := fs.String("cache", "", "cache directories, comma-separated (default: the config's data.cache)")
	cachesFlag := fs.String("caches", "", "several teachers' caches over the same samples, comma-separated, each DIR or NAME=DIR (names t0, t1, ... by default; weights 1): KD and top-1 agreement per teacher (default: the config's data.caches, with its names and weights)")
	rng := fs.String("range", "", "sample range START:END (default: the config's data.eval_range, else the one the checkpoint's run held out, else every sample)")
	seqLen := fs.Int("seq-len", 0, "packed row length (default: the config's data.seq_len, else 2048)")
	tokFP := fs.String("tokenizer-fingerprint", "", "the student's tokenizer fingerprint (default: the checkpoint's, the config's, else the tokenizer.json in --checkpoint's directory)")
	tokDir := fs.String("tokenizer", "", "directory with the student's tokenizer.json (alternative to --tokenizer-fingerprint; default: as for --tokenizer-fingerprint)")
	asJSON := fs.Bool("json", false, "print every metric and the loss settings as one JSON object")
	dev := fs.String("device", "auto", "where the student's forward runs: auto (the GPU when one's CUDA backend opens, else the CPU), cpu or cuda (the GPU, or an error naming what is missing)")
	// The loss, over the config's distill section (without --config: the
	// loss the checkpoint's run was trained with, else the defaults).
	// Each sets distill.<key>; read back through fs.Visit below.
	lossFlags := map[string]string{"kd-loss": "kd_loss", "tail": "tail", "temperature": "temperature", "jsd-beta": "jsd_beta",
		"sft-weight": "sft_weight", "kd-weight": "kd_weight", "scale-t2": "scale_t2"}
	fs.String("kd-loss", "", "distill.kd_loss: fwd_kl, rev_kl or jsd (default: the config's, else the training run's, else fwd_kl)")
	fs.String("tail", "", "distill.tail: bucket, renormalize or zero (default: the config's, else the training run's, else bucket)")
	fs.Float64("temperature", 0, "distill.temperature (default: the config's, else the training run's, else 1)")
	fs.Float64("jsd-beta", 0, "distill.jsd_beta, jsd only: 0 = fwd_kl, 1 = rev_kl (default: the config's, else the training run's, else 0.5)")
	fs.Float64("sft-weight", 0, "distill.sft_weight (default: the config's, else the training run's, else 0)")
	fs.Float64("kd-weight", 0, "distill.kd_weight (default: the config's, else the training run's, else 1)")
	fs.Bool("scale-t2", false, "distill.scale_t2: multiply KD by T^2 (default: the config's, else the training run's, else false)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *ckpt == "" {
		return cli.Usagef("--checkpoint is required")
	}
	if *seqLen < 0 {
		// A negative row length was ignored without a word: the eval ran
		// at the config's seq_len (else 2048) as if no --seq-len were given.
		return cli.Usagef("--seq-len %d: want a positive packed row length in tokens (0 or none: the config's data.seq_len, else 2048)", *seqLen)
	}
	if err := device.Check(*dev, device.Inference); err != nil {
		return cli.Usage(err)
	}
	trainer.EvalProgress = evalProgress(evalLog, evalTerminal(evalLog))
	defer func() { trainer.EvalProgress = nil }()
	// Loss flags are sugar for config overrides, so they are validated with
	// the config and their errors name the key.
	var sets, flagged, given []string
	fs.Visit(func(f *flag.Flag) {
		key := lossFlags[f.Name]
		if key == "" {
			return
		}
		v := f.Value.String()
		if f.Name == "kd-loss" || f.Name == "tail" {
			v = strconv.Quote(v)
		}
		sets = append(sets, "distill."+key+"="+v)
		flagged = append(flagged, "--"+f.Name)
		given = append(given, "--"+f.Name+" "+f.Value.String())
	})
	// Without --config, the loss is the one the run was trained under
	// (its checkpoint's state.json and config.yaml), the flags over it.
	lossFrom := "the defaults"
	if *config != "" {
		lossFrom = "--config " + *config
	} else {
		trained, from, err := trainer.TrainedLoss(*ckpt)
		if err != nil {
			return err
		}
		if len(from) > 0 {
			sets = append(trained, sets...)
			lossFrom = "the training run (" + strings.Join(from, ", ") + ")"
		}
	}
	baseFrom := lossFrom // where the settings under the flags came from
	if len(flagged) > 0 {
		lossFrom = strings.Join(flagged, " ") + " over " + lossFrom
	}
	what := "" // the flags as the user gave them, in errors
	if len(given) > 0 {
		what = strings.Join(given, " ") + strings.TrimPrefix(lossFrom, strings.Join(flagged, " "))
	}
	c, err := trainer.LoadEvalConfigAs(*config, sets, what)
	if err != nil {
		return err
	}
	cfg := *c
	if f := fs.Lookup("jsd-beta"); slices.Contains(flagged, "--jsd-beta") && cfg.Distill.KDLoss != "jsd" {
		// A config may carry distill.jsd_beta beside another kd_loss (the
		// example config does; it is read for jsd only), but --jsd-beta on
		// the command line asks for a jsd weight: with another loss it
		// changed nothing, and the eval ran as if it were not given.
		if slices.Contains(flagged, "--kd-loss") {
			return cli.Usagef("--jsd-beta %s with --kd-loss %s: --jsd-beta weighs jsd only (0 = fwd_kl, 1 = rev_kl); give --kd-loss jsd, or leave out --jsd-beta", f.Value, cfg.Distill.KDLoss)
		}
		return cli.Usagef("--jsd-beta %s with kd_loss %s (from %s): --jsd-beta weighs jsd only (0 = fwd_kl, 1 = rev_kl); add --kd-loss jsd, or leave out --jsd-beta", f.Value, cfg.Distill.KDLoss, baseFrom)
	}
	if *cacheDirs != "" && *cachesFlag != "" {
		return cli.Usagef("give only one of --cache (one teacher's cache) and --caches (several teachers' caches)")
	}
	be, err := device.Open(*dev, device.Options{Purpose: device.Inference,
		Logf: func(format string, args ...any) { fmt.Fprintf(evalLog, "eval: "+format+"\n", args...) }})
	if err != nil {
		return err
	}
	defer device.Close(be)
	s, st, err := trainer.LoadStudentOn(*ckpt, be)
	if err != nil {
		return err
	}
	tcs := cfg.Data.Caches
	if *cachesFlag != "" {
		if tcs, err = parseCaches(*cachesFlag); err != nil {
			return err
		}
		// Names and directories in the flag's terms (entry 1, 2, ...);
		// one cache given twice is refused, as in a config.
		if err := trainer.CheckCachesFlag(tcs, "--caches"); err != nil {
			return cli.Usage(err)
		}
		cfg.Data.Caches = tcs
		if err := cfg.ValidateEval(); err != nil {
			return fmt.Errorf("--caches: %w", err)
		}
	}
	if cfg.Data.Dataset != nil && *cacheDirs == "" && len(tcs) == 0 {
		return evalDataset(s, st, &cfg, *config != "", *ckpt, *tokDir, *rng, *seqLen, *asJSON, lossFrom)
	}
	if len(tcs) > 0 && *cacheDirs == "" {
		return evalTeachers(s, st, &cfg, *config != "", tcs, *ckpt, *tokFP, *tokDir, *rng, *seqLen, *asJSON, lossFrom)
	}
	dirs := cfg.Data.Cache
	if *cacheDirs != "" {
		dirs = strings.Split(*cacheDirs, ",")
	}
	if len(dirs) == 0 {
		return cli.Usagef("--cache is required (or a --config with data.cache)")
	}
	return evalCache(s, st, &cfg, *config != "", dirs, *ckpt, *tokFP, *tokDir, *rng, *seqLen, *asJSON, lossFrom)
}

// parseCaches reads --caches: DIR or NAME=DIR entries, comma-separated.
func parseCaches(v string) ([]trainer.TeacherCache, error) {
	var tcs []trainer.TeacherCache
	for _, e := range strings.Split(v, ",") {
		name, dir, ok := strings.Cut(e, "=")
		if !ok {
			name, dir = "", e
		}
		if dir == "" {
			return nil, cli.Usagef("--caches %q: an empty entry: want DIR or NAME=DIR, comma-separated", v)
		}
		tcs = append(tcs, trainer.TeacherCache{Dir: trainer.Dirs{dir}, Name: name})
	}
	return tcs, nil
}

// evalCache scores the student on one teacher's cache (dirs: one cache,
// or the directories of one read together).
func evalCache(s *train.Student, st *trainer.State, cfg *trainer.Config, configGiven bool, dirs []string, ckpt, tokFP, tokDir, rng string, seqLen int, asJSON bool, lossFrom string) error {
	rd, err := cache.OpenReader(dirs...)
	if err != nil {
		return err
	}
	m := rd.Manifest()
	fp, err := studentTokenizer(st, cfg, tokFP, tokDir, ckpt, strings.Join(dirs, ","), m.TokenizerFingerprint)
	if err != nil {
		return err
	}
	if err := trainer.CheckCache(s.Cfg, fp, &m, strings.Join(dirs, ",")); err != nil {
		return err
	}
	r, rs, err := evalRange(rng, cfg, st, configGiven, m.Samples, "the cache's samples", m.DatasetFingerprint)
	if err != nil {
		return err
	}
	if seqLen > 0 {
		cfg.Data.SeqLen = seqLen
	}
	lo := cfg.LossOptions(float64(m.Temperature))
	if err := lo.Validate(); err != nil {
		return fmt.Errorf("distill (cache captured at temperature %g): %w", m.Temperature, err)
	}
	es, err := trainer.Evaluate(s, rd, r, cfg.Data.SeqLen, cfg.Data.Truncate, &lo)
	if err != nil {
		return rowLenError(err, seqLen, configGiven, false)
	}
	if asJSON {
		return json.NewEncoder(stdout).Encode(evalReport{EvalStats: es, Range: [2]int64{r.Start, r.End}, RangeFrom: rs.from, HeldOut: rs.heldOut(r),
			Loss: cfg.Distill, LossFrom: lossFrom, TeacherTemperature: float64(m.Temperature)})
	}
	d := cfg.Distill
	printLoss(d, lossFrom)
	rs.print(r)
	fmt.Fprintf(stdout, "samples %v (%d), %d loss positions\nloss %.5f  kd(%s, tail %s, T %g) %.5f  ce %.5f  token_accuracy %.4f  top1_agreement %.4f  ece %.4f\n",
		r, es.Samples, es.Tokens, es.Loss, d.KDLoss, d.Tail, d.Temperature, es.KD, es.CE, es.TokenAccuracy, es.Top1Agreement, es.ECE)
	return nil
}

// rangeSource is where eval's sample range came from, and what the
// checkpoint's run held out of training (run false: the checkpoint
// records no training run).
type rangeSource struct {
	from  string
	run   bool
	held  []int64
	other string // why held does not apply: the samples are of another dataset
}

// evalRange is the sample range eval scores: --range, else the config's
// data.eval_range, else the one the checkpoint's run held out, else every
// sample (the zero Range when samples < 0: a dataset's, resolved later).
// samples bounds --range when >= 0; what names the indices. dataset is
// the samples' dataset fingerprint (a cache's; "": not known): when the
// checkpoint's run trained from a cache of another dataset, its held-out
// indices are not these samples'.
func evalRange(rng string, cfg *trainer.Config, st *trainer.State, configGiven bool, samples int64, what, dataset string) (cache.Range, rangeSource, error) {
	rs := rangeSource{run: st != nil}
	if st != nil && len(st.EvalRange) == 2 {
		rs.held = st.EvalRange
	}
	if st != nil && st.CacheTeacher != "" && dataset != "" && st.CacheDataset != dataset {
		rs.other = fmt.Sprintf("the cache holds another dataset (%.12s) than the run trained on (%.12s): whether the run trained on these samples is unknown", dataset, st.CacheDataset)
	}
	var r cache.Range
	switch {
	case rng != "":
		a, b, ok := strings.Cut(rng, ":")
		x, err1 := strconv.ParseInt(a, 10, 64)
		y, err2 := strconv.ParseInt(b, 10, 64)
		malformed := !ok || err1 != nil || err2 != nil || x < 0 || y <= x
		if malformed || (samples >= 0 && y > samples) {
			err := fmt.Errorf("--range %q: want START:END with 0 <= START < END (%s)", rng, what)
			if samples >= 0 {
				err = fmt.Errorf("--range %q: want START:END with 0 <= START < END <= %d (%s)", rng, samples, what)
			}
			if malformed {
				// Wrong whatever the data: a usage error (exit 2). A
				// range past the samples is wrong for these caches only (1).
				err = cli.Usage(err)
			}
			return r, rs, err
		}
		r, rs.from = cache.Range{Start: x, End: y}, "--range"
	case len(cfg.Data.EvalRange) == 2:
		r, rs.from = cache.Range{Start: cfg.Data.EvalRange[0], End: cfg.Data.EvalRange[1]}, "the config's data.eval_range"
		if !configGiven {
			rs.from = "data.eval_range"
		}
	case rs.held != nil:
		r, rs.from = cache.Range{Start: rs.held[0], End: rs.held[1]}, "the training run's data.eval_range (held out)"
		if rs.other != "" { // its indices, but of another dataset's samples
			rs.from = "the training run's data.eval_range, as indices into this cache"
		}
	default:
		rs.from = "every sample: no --range, and no data.eval_range in a config or the checkpoint's run"
		if samples >= 0 {
			r = cache.Range{Start: 0, End: samples}
		}
	}
	return r, rs, nil
}

// rangeError is err, a range past the samples (trainer.RangeError: a
// dataset's are counted only once it is read), said in the terms of
// where the range came from: `--range "0:500"`, as the flag's own check
// says it, or the data.eval_range it was ([0, 500], as written), not
// "sample range [0, 500)".
func (rs rangeSource) rangeError(err error, rng string) error {
	var re *trainer.RangeError
	if !errors.As(err, &re) {
		return err
	}
	if rs.from == "--range" {
		return errkind.Reword(trainer.ErrConfig, err, "--range %q: want START:END with 0 <= START < END <= %d (%s)", rng, re.Samples, re.Of)
	}
	// As the config writes the key: [start, end].
	return errkind.Reword(trainer.ErrConfig, err, "%s [%d, %d]: want 0 <= start < end <= %d (%s): give --range START:END within them", rs.from, re.Range.Start, re.Range.End, re.Samples, re.Of)
}

// heldOut says whether the checkpoint's run held r out of training:
// yes, no, partly, or unknown (the checkpoint records no training run).
func (rs rangeSource) heldOut(r cache.Range) string {
	switch {
	case !rs.run || rs.other != "":
		return "unknown"
	case rs.held == nil || r.End <= rs.held[0] || r.Start >= rs.held[1]:
		return "no"
	case r.Start >= rs.held[0] && r.End <= rs.held[1]:
		return "yes"
	}
	return "partly"
}

// print says which range eval scored, where it came from, and whether
// the run trained on it.
func (rs rangeSource) print(r cache.Range) {
	var note string
	switch rs.heldOut(r) {
	case "unknown":
		note = "the checkpoint records no training run: whether these samples were trained on is unknown"
		if rs.other != "" {
			note = rs.other
		}
	case "yes":
		note = "held out: the run never trained on them"
	case "no":
		if rs.held == nil {
			note = "training samples: the run held none out"
		} else {
			note = fmt.Sprintf("training samples: the run held out only %v", cache.Range{Start: rs.held[0], End: rs.held[1]})
		}
	default:
		note = fmt.Sprintf("partly training samples: the run held out only %v", cache.Range{Start: rs.held[0], End: rs.held[1]})
	}
	fmt.Fprintf(stdout, "range %v (%s): %s\n", r, rs.from, note)
}

// studentTokenizer is the student's tokenizer fingerprint: --tokenizer-fingerprint,
// --tokenizer's, the checkpoint's, the config's, or that of the
// tokenizer.json in the checkpoint directory. ckpt is --checkpoint,
// and cacheDir and cacheFP the cache scored and its tokenizer, for the
// error when none of these is given.
func studentTokenizer(st *trainer.State, cfg *trainer.Config, tokFP, tokDir, ckpt, cacheDir, cacheFP string) (string, error) {
	switch {
	case tokFP != "":
		return tokFP, nil
	case tokDir != "":
		tk, err := tokenizer.Load(tokDir)
		if err != nil {
			return "", err
		}
		return tk.Fingerprint(), nil
	case st != nil && st.TokenizerFingerprint != "":
		return st.TokenizerFingerprint, nil
	case cfg.Model.TokenizerFingerprint != "":
		return cfg.Model.TokenizerFingerprint, nil
	}
	// An HF checkpoint records no tokenizer; one that ships its
	// tokenizer.json (an exported student) names it by that file.
	if dir := ckptTokenizerDir(ckpt); dir != "" {
		tk, err := loadCkptTokenizer(dir)
		if err != nil {
			return "", err
		}
		return tk.Fingerprint(), nil
	}
	// An HF checkpoint records no tokenizer, so this is what a first
	// eval of one (an exported student, a teacher) meets: say what to
	// type, the checkpoint's own tokenizer.json and the cache's
	// fingerprint (cachectl status prints it), not only the flags' names.
	var ways []string
	if cacheFP != "" {
		ways = append(ways, fmt.Sprintf("--tokenizer-fingerprint %s (cache %s was filled with that tokenizer: the student must tokenize as it did)", cacheFP, cacheDir))
	}
	hint := ""
	if len(ways) > 0 {
		hint = "; e.g. " + strings.Join(ways, ", or ")
	}
	return "", fmt.Errorf("the student's tokenizer is unknown (--checkpoint %s records none): give --tokenizer DIR (the student's tokenizer.json) or --tokenizer-fingerprint FP (a trainer checkpoint records it)%s", ckpt, hint)
}

// evalTeachers is `student eval` on several teachers' caches (--caches or
// the config's data.caches): the objective's KD is the weighted sum of the
// teachers' divergences, and each teacher's KD and top-1 agreement are
// printed beside it.
func evalTeachers(s *train.Student, st *trainer.State, cfg *trainer.Config, configGiven bool, tcs []trainer.TeacherCache, ckpt, tokFP, tokDir, rng string, seqLen int, asJSON bool, lossFrom string) error {
	// Teacher 0's manifest: the capture temperature the loss needs (the
	// others must agree, which EvaluateTeachers checks) and the samples.
	rd, err := cache.OpenReader(tcs[0].Dir...)
	if err != nil {
		return err
	}
	m := rd.Manifest()
	fp, err := studentTokenizer(st, cfg, tokFP, tokDir, ckpt, strings.Join([]string(tcs[0].Dir), ","), m.TokenizerFingerprint)
	if err != nil {
		return err
	}
	r, rs, err := evalRange(rng, cfg, st, configGiven, m.Samples, "the caches' samples", m.DatasetFingerprint)
	if err != nil {
		return err
	}
	if seqLen > 0 {
		cfg.Data.SeqLen = seqLen
	}
	lo := cfg.LossOptions(float64(m.Temperature))
	if err := lo.Validate(); err != nil {
		return fmt.Errorf("distill (caches captured at temperature %g): %w", m.Temperature, err)
	}
	es, err := trainer.EvaluateTeachers(s, fp, tcs, r, cfg.Data.SeqLen, cfg.Data.Truncate, &lo)
	if err != nil {
		return rowLenError(rs.rangeError(err, rng), seqLen, configGiven, false)
	}
	if asJSON {
		return json.NewEncoder(stdout).Encode(evalReport{EvalStats: es, Range: [2]int64{r.Start, r.End}, RangeFrom: rs.from, HeldOut: rs.heldOut(r),
			Loss: cfg.Distill, LossFrom: lossFrom, TeacherTemperature: float64(m.Temperature)})
	}
	d := cfg.Distill
	printLoss(d, lossFrom)
	rs.print(r)
	fmt.Fprintf(stdout, "samples %v (%d), %d loss positions, %d teachers\nloss %.5f  kd(%s, tail %s, T %g; weighted sum) %.5f  ce %.5f  token_accuracy %.4f  top1_agreement %.4f (weighted mean)\n",
		r, es.Samples, es.Tokens, len(es.Teachers), es.Loss, d.KDLoss, d.Tail, d.Temperature, es.KD, es.CE, es.TokenAccuracy, es.Top1Agreement)
	for _, t := range es.Teachers {
		fmt.Fprintf(stdout, "teacher %s (weight %g): kd %.5f  top1_agreement %.4f\n", t.Name, t.Weight, t.KD, t.Top1)
	}
	return nil
}

// evalDataset is `student eval` on the config's data.dataset (no
// --cache): the samples are read as the training run read them (tokenized
// with the student's tokenizer, or, pre-tokenized, with none: their ids
// are checked against the student's vocab_size), and scored on CE and
// token accuracy (no teacher, so no KD).
func evalDataset(s *train.Student, st *trainer.State, cfg *trainer.Config, configGiven bool, ckpt, tokDir, rng string, seqLen int, asJSON bool, lossFrom string) error {
	tok, err := datasetTokenizer(st, cfg, ckpt, tokDir)
	if err != nil {
		return err
	}
	r, rs, err := evalRange(rng, cfg, st, configGiven, -1, "dataset sample indices", "")
	if err != nil {
		return err
	}
	// The samples as training cut them (max_len 0 is the config's
	// seq_len), packed into rows of --seq-len when given.
	dc := *cfg.Data.Dataset
	if dc.MaxLen == 0 {
		dc.MaxLen = cfg.Data.SeqLen
	}
	if seqLen > 0 {
		cfg.Data.SeqLen = seqLen
	}
	lo := cfg.LossOptions(cfg.Distill.Temperature)
	if err := lo.Validate(); err != nil {
		return fmt.Errorf("distill: %w", err)
	}
	es, r, err := trainer.EvaluateDataset(s, &dc, tok, cfg.Data.SeqLen, r, &lo)
	if err != nil {
		return rowLenError(rs.rangeError(err, rng), seqLen, configGiven, true)
	}
	if asJSON {
		return json.NewEncoder(stdout).Encode(evalReport{EvalStats: es, Range: [2]int64{r.Start, r.End}, RangeFrom: rs.from, HeldOut: rs.heldOut(r),
			Loss: cfg.Distill, LossFrom: lossFrom})
	}
	rs.print(r)
	fmt.Fprintf(stdout, "dataset samples %v (%d%s), %d loss positions\nce %.5f  token_accuracy %.4f  (no teacher: no KD)\n", r, es.Samples, unscored(es.Unscored), es.Tokens, es.CE, es.TokenAccuracy)
	return nil
}

// unscored says which of the range's samples were not scored, and why:
// ", 2 not scored (longer than max-len: 1, no input_ids: 1)", or "".
func unscored(reasons map[string]int64) string {
	if len(reasons) == 0 {
		return ""
	}
	var n int64
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(reasons)) {
		n += reasons[k]
		parts = append(parts, fmt.Sprintf("%s: %d", k, reasons[k]))
	}
	return fmt.Sprintf(" scored, %d not scored (%s)", n, strings.Join(parts, ", "))
}

// datasetTokenizer is the student's tokenizer that reads the config's
// data.dataset: --tokenizer, the run's, model.tokenizer, model.init_from's
// or the tokenizer.json in ckpt (--checkpoint); none (nil) for a
// pre-tokenized dataset, which training reads without one too.
func datasetTokenizer(st *trainer.State, cfg *trainer.Config, ckpt, tokDir string) (*tokenizer.Tokenizer, error) {
	if cfg.Data.Dataset.Pretokenized {
		if tokDir != "" {
			return nil, cli.Usagef("--tokenizer %s: data.dataset is pre-tokenized (data.dataset.pretokenized: true): its input_ids are read as they are, checked against the student's vocab_size, and no tokenizer is used; leave out --tokenizer", tokDir)
		}
		return nil, nil
	}
	dir := tokDir
	switch {
	case dir != "":
	case st != nil && st.TokenizerDir != "":
		dir = st.TokenizerDir
	case cfg.Model.Tokenizer != "":
		dir = cfg.Model.Tokenizer
	case cfg.Model.InitFrom != "":
		dir = cfg.Model.InitFrom
	case ckptTokenizerDir(ckpt) != "":
		return loadCkptTokenizer(ckpt)
	default:
		return nil, fmt.Errorf("data.dataset: tokenizing the dataset needs the student's tokenizer: give --tokenizer DIR (a directory with tokenizer.json); if its records are pre-tokenized (input_ids), set data.dataset.pretokenized: true")
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", dir, err)
	}
	if st != nil && st.TokenizerFingerprint != "" && st.TokenizerFingerprint != tok.Fingerprint() {
		return nil, fmt.Errorf("the tokenizer in %s (fingerprint %s) is not the one the student was trained with (%s): give --tokenizer with the run's tokenizer", dir, tok.Fingerprint(), st.TokenizerFingerprint)
	}
	return tok, nil
}

// rowLenError says a sample longer than the row length in the terms the
// length was given in: the trainer's message names data.seq_len and
// data.truncate, but eval takes --seq-len (seqLen > 0), and without
// --config it has no config keys at all. dataset: the samples are the
// config's data.dataset, which data.truncate does not cut (max_len does).
func rowLenError(err error, seqLen int, configGiven, dataset bool) error {
	var tl *trainer.SampleTooLongError
	if !errors.As(err, &tl) {
		return err
	}
	cut := "or give a --config with data: {truncate: true} to cut such samples"
	switch {
	case dataset:
		cut = "or lower data.dataset.max_len in the --config to cut the samples shorter"
	case configGiven:
		cut = "or set data.truncate: true in the --config to cut such samples"
	}
	var msg string
	switch {
	case seqLen > 0:
		msg = fmt.Sprintf("sample %d has %d tokens, more than --seq-len %d: raise --seq-len (to %d or more: a row never splits a sample), %s", tl.Index, tl.Tokens, tl.SeqLen, tl.Tokens, cut)
	case configGiven:
		msg = fmt.Sprintf("sample %d has %d tokens, more than data.seq_len %d of the --config: raise data.seq_len (or give --seq-len %d or more), %s", tl.Index, tl.Tokens, tl.SeqLen, tl.Tokens, cut)
	default:
		msg = fmt.Sprintf("sample %d has %d tokens, more than the default row length %d (no --seq-len, no --config): give --seq-len %d or more, %s", tl.Index, tl.Tokens, tl.SeqLen, tl.Tokens, cut)
	}
	return errkind.Reword(trainer.ErrData, err, "%s", msg)
}

// ckptTokenizerDir is ckpt when it holds a tokenizer.json (an HF
// checkpoint with its tokenizer beside config.json), else "".
func ckptTokenizerDir(ckpt string) string {
	if fi, err := os.Stat(filepath.Join(ckpt, "tokenizer.json")); err == nil && !fi.IsDir() {
		return ckpt
	}
	return ""
}

// loadCkptTokenizer loads the checkpoint's own tokenizer.json, the default
// when nothing else names the student's tokenizer, and says so: a default
// the user did not type is one they should see.
func loadCkptTokenizer(dir string) (*tokenizer.Tokenizer, error) {
	p := filepath.Join(dir, "tokenizer.json")
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return nil, fmt.Errorf("the checkpoint's tokenizer %s (the default when the checkpoint records none): %w; fix it, or give --tokenizer DIR (the student's tokenizer.json) or --tokenizer-fingerprint FP", p, err)
	}
	fmt.Fprintf(evalLog, "eval: tokenizer: %s, the checkpoint's (fingerprint %s; --tokenizer or --tokenizer-fingerprint to use another)\n", p, tk.Fingerprint())
	return tk, nil
}

// printLoss names the loss eval measures under and where its settings
// came from.
func printLoss(d trainer.DistillConfig, from string) {
	t2 := ""
	if d.ScaleT2 {
		t2 = ", scaled by T^2"
	}
	beta := ""
	if d.KDLoss == "jsd" {
		beta = fmt.Sprintf(" (beta %g)", d.JSDBeta)
	}
	fmt.Fprintf(stdout, "loss: kd_loss %s%s, tail %s, temperature %g%s, kd_weight %g, sft_weight %g (from %s)\n",
		d.KDLoss, beta, d.Tail, d.Temperature, t2, d.KDWeight, d.SFTWeight, from)
}

// stdout is where eval prints its result (tests capture it).
var stdout io.Writer = os.Stdout

// evalLog is where eval draws its progress (tests capture it), and
// evalTerminal says whether it is a terminal (a bar redrawn in place;
// elsewhere a line every evalLogEvery).
var (
	evalLog      io.Writer = os.Stderr
	evalTerminal           = func(w io.Writer) bool {
		f, ok := w.(*os.File)
		if !ok {
			return false
		}
		st, err := f.Stat()
		return err == nil && st.Mode()&os.ModeCharDevice != 0
	}
	evalLogEvery = 10 * time.Second
)

// evalProgress reports eval's progress as train does: on a terminal a
// bar with the rows done, the positions scored, the rate and the ETA,
// cleared at the end; elsewhere the same as a line every evalLogEvery.
func evalProgress(w io.Writer, tty bool) func(done, total, positions int) {
	start := time.Now()
	var last time.Time
	return func(done, total, positions int) {
		el := time.Since(start)
		if !tty && done < total && time.Since(last) < evalLogEvery {
			return
		}
		last = time.Now()
		eta := "?"
		if done > 0 {
			eta = (time.Duration(float64(el) / float64(done) * float64(total-done))).Round(time.Second).String()
		}
		rate := float64(positions) / max(el.Seconds(), 1e-9)
		if !tty {
			fmt.Fprintf(w, "eval: %d/%d rows, %d positions, %.0f positions/s, %s elapsed, eta %s\n", done, total, positions, rate, el.Round(time.Second), eta)
			return
		}
		const width = 30
		n := width * done / max(total, 1)
		fmt.Fprintf(w, "\reval [%s%s] %d/%d rows  %d positions  %.0f positions/s  eta %s   ", strings.Repeat("=", n), strings.Repeat(" ", width-n), done, total, positions, rate, eta)
		if done == total {
			fmt.Fprintf(w, "\r%-110s\n", fmt.Sprintf("eval: %d rows, %d positions in %s", total, positions, el.Round(time.Millisecond)))
		}
	}
}

// evalReport is `student eval --json`: every metric of trainer.EvalStats
// at the top level, the sample range, and the loss they were measured
// under.
type evalReport struct {
	trainer.EvalStats
	Range              [2]int64              `json:"range"`
	RangeFrom          string                `json:"range_from"`
	HeldOut            string                `json:"held_out"` // yes, no, partly or unknown: whether the run held the range out of training
	Loss               trainer.DistillConfig `json:"distill"`
	LossFrom           string                `json:"distill_from"`
	TeacherTemperature float64               `json:"teacher_temperature"`
}
