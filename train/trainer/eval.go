package trainer

import (
	"fmt"
	"math"

	"distill/cache"
	"distill/data"
	"distill/data/tokenizer"
	"distill/train"
	"distill/train/loss"
)

// EvalStats are the evaluation metrics over the counted positions of the
// held-out samples.
type EvalStats struct {
	Loss float64 `json:"loss"` // the weighted training objective
	KD   float64 `json:"kd"`   // the divergence to the teacher's top-k
	CE   float64 `json:"ce"`   // cross-entropy on the labels
	// TokenAccuracy is how often the student's argmax is the label.
	TokenAccuracy float64 `json:"token_accuracy"`
	// Top1Agreement is how often the student's argmax is the teacher's
	// (0 on a dataset: there is no teacher).
	Top1Agreement float64 `json:"top1_agreement"`
	// ECE is the expected calibration error of the student's top-1 on
	// the labels: the positions binned by the student's probability of
	// its argmax (ECEBins equal bins of [0, 1]), Σ_b (n_b/n)·|accuracy_b
	// - mean confidence_b| (Guo et al. 2017).
	ECE     float64 `json:"ece"`
	Tokens  int     `json:"tokens"`
	Samples int     `json:"samples"`
	// Unscored counts a dataset's samples in the range that were not
	// scored, by reason (longer than max_len under drop; a bad record
	// under skip_bad): EvaluateDataset's only.
	Unscored map[string]int64 `json:"unscored,omitempty"`
	// Teachers are the per-teacher numbers of multi-teacher KD
	// (data.caches), in its order; Top1Agreement is then their
	// weight-averaged agreement and KD the weighted sum of theirs.
	Teachers []TeacherMetrics `json:"teachers,omitempty"`
}

// evaluator is the run's periodic eval: the student over the held-out
// samples of the run's source, packed as training packs them, scored
// over every loss position.
type evaluator struct {
	s        *train.Student
	src      Source
	r        cache.Range // the samples each eval reads (Start < 0: none)
	lopt     *loss.Options
	teachers []TeacherState // multi-teacher KD: their names and weights
	stop     stopSignal     // abandons the eval between rows (errStopped)
	g        *ranks         // data parallel: each rank scores its rows, then the sums are summed
}

// run evaluates the student; ok is false when the run holds no samples
// out.
func (e *evaluator) run() (es EvalStats, ok bool, err error) {
	if e.r.Start < 0 {
		return es, false, nil
	}
	rows, n, err := e.src.EvalRows(e.r)
	if err != nil {
		return es, true, err
	}
	var mine func(int) bool
	if e.g != nil && e.g.size > 1 {
		mine = e.g.mine
	}
	sums, err := scoreRows(e.s, rows, mine, e.lopt, e.stop.requested)
	if err != nil {
		return es, true, err
	}
	if e.s.ShardStage() == 3 {
		// A forward gathers the blocks' weights: every rank runs as many
		// as rank 0 (scoreRows runs two a row: the loss, the prediction).
		for k := e.g.rowsOf(len(rows), e.g.rank); k < e.g.rowsOf(len(rows), 0); k++ {
			e.s.Phantom(false)
			e.s.Phantom(false)
		}
	}
	if mine != nil {
		e.g.reduceEval(&sums, len(e.teachers))
	}
	es = sums.stats(n)
	nameTeachers(es.Teachers, e.teachers)
	return es, true, nil
}

// Evaluate runs the student over samples [r.Start, r.End) of rd, packed
// into rows of seqLen tokens, and averages the metrics over every counted
// position (so the result does not depend on the packing).
func Evaluate(s *train.Student, rd *cache.Reader, r cache.Range, seqLen int, truncate bool, opt *loss.Options) (EvalStats, error) {
	src := &cacheSource{rd: rd, pk: newCachePacker(rd, nil, seqLen, truncate)}
	return evaluateSource(s, src, r, opt)
}

// evaluateSource evaluates the student on samples r of a cache source,
// with no stop, its teachers named.
func evaluateSource(s *train.Student, src *cacheSource, r cache.Range, opt *loss.Options) (EvalStats, error) {
	rows, n, err := src.EvalRows(r)
	if err != nil {
		return EvalStats{}, err
	}
	es, err := evaluateRows(s, rows, n, opt, nil)
	nameTeachers(es.Teachers, src.ts.states())
	return es, err
}

// EvaluateTeachers is Evaluate with several teachers' caches over the same
// samples (a config's data.caches, resolved names and weights default), with
// each teacher's KD and top-1 agreement in EvalStats.Teachers. The caches
// are checked against each other and the student (tokFP: its tokenizer
// fingerprint).
func EvaluateTeachers(s *train.Student, tokFP string, tcs []TeacherCache, r cache.Range, seqLen int, truncate bool, opt *loss.Options) (EvalStats, error) {
	ts, err := openTeachers(tcs, 1)
	if err != nil {
		return EvalStats{}, err
	}
	if err := ts.check(s.Cfg, tokFP); err != nil {
		return EvalStats{}, err
	}
	if r.End == 0 {
		r.End = ts.ms[0].Samples
	}
	if r.Start < 0 || r.End <= r.Start || r.End > ts.ms[0].Samples {
		return EvalStats{}, &RangeError{Range: r, Samples: ts.ms[0].Samples, Of: "the caches' samples"}
	}
	src := &cacheSource{rd: ts.rds[0], ts: ts, pk: newCachePacker(ts.rds[0], ts, seqLen, truncate)}
	return evaluateSource(s, src, r, opt)
}

// RangeError is an eval's sample range that is not within the Samples
// samples Of names (the dataset's, the caches'), which are counted only
// when they are opened. Its message says "sample range"; a command names
// where the range came from instead (student eval --range) from its
// fields. It wraps ErrConfig.
type RangeError struct {
	Range   cache.Range
	Samples int64
	Of      string
}

func (e *RangeError) Error() string {
	return fmt.Sprintf("sample range %v: want 0 <= start < end <= %d (%s)", e.Range, e.Samples, e.Of)
}

func (e *RangeError) Unwrap() error { return ErrConfig }

// EvalProgress, when not nil, is told how far Evaluate, EvaluateTeachers
// and EvaluateDataset are (not a training run's periodic evals, which
// pass a stop function): after each packed row, the rows done, their
// total and the loss positions scored so far. `student eval` draws its
// progress bar from it.
var EvalProgress func(done, total, positions int)

// evaluateRows evaluates packed rows holding n samples. Rows without a
// teacher (K = 0, a dataset's) have no top-1 agreement: it stays 0.
func evaluateRows(s *train.Student, rows []*train.Batch, n int, opt *loss.Options, stop func() bool) (EvalStats, error) {
	sums, err := scoreRows(s, rows, nil, opt, stop)
	if err != nil {
		return EvalStats{}, err
	}
	return sums.stats(n), nil
}

// evalSums are an eval's sums over its loss positions, before they are
// averaged: the losses weighted by positions, and the counts.
type evalSums struct {
	loss, kd, ce       float64
	tokens, acc, agree int
	teachers           []TeacherMetrics // KD sums and weights
	tAgree             []int
	// The calibration bins: positions, correct top-1s, summed confidence.
	binN, binAcc [ECEBins]int
	binConf      [ECEBins]float64
}

// ECEBins is the number of confidence bins of EvalStats.ECE (15, as Guo
// et al. and the sparse-logit-sampling paper bin).
const ECEBins = 15

// bin adds a position of top-1 probability p, correct or not.
func (es *evalSums) bin(p float64, correct bool) {
	b := min(int(p*ECEBins), ECEBins-1)
	es.binN[b]++
	es.binConf[b] += p
	if correct {
		es.binAcc[b]++
	}
}

// ece is the expected calibration error of the bins.
func (es *evalSums) ece() float64 {
	var n int
	for _, c := range es.binN {
		n += c
	}
	if n == 0 {
		return 0
	}
	var e float64
	for b, c := range es.binN {
		if c > 0 {
			e += math.Abs(float64(es.binAcc[b])-es.binConf[b]) / float64(n)
		}
	}
	return e
}

// scoreRows adds up the scores of rows (those mine picks, all when nil).
func scoreRows(s *train.Student, rows []*train.Batch, mine func(int) bool, opt *loss.Options, stop func() bool) (evalSums, error) {
	var es evalSums
	progress := EvalProgress
	if stop != nil {
		progress = nil
	}
	for ri, b := range rows {
		if progress != nil {
			progress(ri, len(rows), es.tokens)
		}
		if stop != nil && stop() {
			return es, errStopped
		}
		if mine != nil && !mine(ri) {
			continue
		}
		st, err := s.Forward(b, opt)
		if err != nil {
			return es, err
		}
		w := float64(st.Tokens)
		es.loss += st.Loss * w
		es.kd += st.KD * w
		es.ce += st.CE * w
		es.tokens += st.Tokens
		if len(b.Teachers) > 0 && es.teachers == nil {
			es.teachers = make([]TeacherMetrics, len(b.Teachers))
			es.tAgree = make([]int, len(b.Teachers))
			for i, te := range b.Teachers {
				es.teachers[i].Weight = te.Weight
			}
		}
		for i, ts := range st.Teachers {
			es.teachers[i].KD += ts.KD * w
		}
		pred, lps, err := s.Top1(b)
		if err != nil {
			return es, err
		}
		for q := 0; q+1 < len(b.Starts); q++ {
			for t := b.Starts[q]; t+1 < b.Starts[q+1]; t++ {
				if b.Mask[t+1] == 0 {
					continue
				}
				if pred[t] == b.Tokens[t+1] {
					es.acc++
				}
				es.bin(math.Exp(float64(lps[t])), pred[t] == b.Tokens[t+1])
				if b.K > 0 && pred[t] == b.TopIDs[int(t)*b.K] {
					es.agree++
				}
				for i, te := range b.Teachers {
					if pred[t] == te.TopIDs[int(t)*te.K] {
						es.tAgree[i]++
					}
				}
			}
		}
	}
	if progress != nil {
		progress(len(rows), len(rows), es.tokens)
	}
	return es, nil
}

// stats averages the sums over the loss positions, for n samples.
func (es *evalSums) stats(n int) EvalStats {
	out := EvalStats{Samples: n, Tokens: es.tokens}
	if es.tokens == 0 {
		return out
	}
	w := float64(es.tokens)
	out.Loss, out.KD, out.CE = es.loss/w, es.kd/w, es.ce/w
	out.TokenAccuracy, out.Top1Agreement = float64(es.acc)/w, float64(es.agree)/w
	out.ECE = es.ece()
	if len(es.teachers) > 0 {
		out.Teachers = make([]TeacherMetrics, len(es.teachers))
		var a, ws float64
		for i, te := range es.teachers {
			out.Teachers[i] = TeacherMetrics{Weight: te.Weight, KD: te.KD / w, Top1: float64(es.tAgree[i]) / w}
			a += te.Weight * out.Teachers[i].Top1
			ws += te.Weight
		}
		if ws > 0 {
			out.Top1Agreement = a / ws
		}
	}
	return out
}

// EvaluateDataset runs the student over samples [r.Start, r.End) of the
// dataset dc (r.End 0: to the dataset's end), read as a training run on dc
// reads it (recordTokenizer: tokenized with tok, or, pre-tokenized, with
// no tokenizer, tok nil, its ids checked against the student's vocab_size)
// and packed into rows of seqLen tokens exactly as such a run reads its
// eval_range. It returns the range evaluated. There is no teacher: KD and
// top-1 agreement are 0.
func EvaluateDataset(s *train.Student, dc *DatasetConfig, tok *tokenizer.Tokenizer, seqLen int, r cache.Range, opt *loss.Options) (EvalStats, cache.Range, error) {
	dtok, err := recordTokenizer(dc, tok, "", s.Cfg.VocabSize, "give --tokenizer DIR (a directory with tokenizer.json)")
	if err != nil {
		return EvalStats{}, r, err
	}
	opts, err := dc.options(seqLen)
	if err != nil {
		return EvalStats{}, r, err
	}
	ds, err := data.Open(dc.sources(), dtok, opts)
	if err != nil {
		return EvalStats{}, r, fmt.Errorf("data.dataset: %w", err)
	}
	defer ds.Close()
	if r.End == 0 {
		r.End = ds.Len()
	}
	if r.Start < 0 || r.End <= r.Start || r.End > ds.Len() {
		return EvalStats{}, r, &RangeError{Range: r, Samples: ds.Len(), Of: "the dataset's samples"}
	}
	src := &datasetSource{ds: ds, pk: &packer{seqLen: seqLen}}
	rows, n, err := src.EvalRows(r)
	if err != nil {
		return EvalStats{}, r, err
	}
	es, err := evaluateRows(s, rows, n, opt, nil)
	if st := ds.Stats(); st.Dropped+st.Skipped > 0 {
		es.Unscored = st.Reasons
	}
	return es, r, err
}
