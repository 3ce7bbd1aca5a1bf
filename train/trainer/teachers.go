package trainer

import (
	"fmt"
	"slices"
	"strings"

	"distill/cache"
	"distill/internal/errkind"
	"distill/model"
	"distill/train/loss"
)

// teacherTopK is one teacher's top-k of a sample: (T, K) ids and
// log-probs, as cache.Sample holds them.
type teacherTopK struct {
	IDs []int32
	LPs []float32
}

// teacherSet is data.caches opened: several teachers' caches over the
// same samples. Teacher 0's cache gives the training order (its seeded
// shuffle, as data.cache's); the others are read by sample index and
// checked to hold the same tokens and mask as teacher 0, sample by
// sample.
type teacherSet struct {
	names   []string
	weights []float64
	dirs    [][]string
	rds     []*cache.Reader
	ms      []cache.Manifest
}

// openTeachers opens data.caches and checks that the caches describe the
// same samples: dataset fingerprint, sample count, vocabulary, tokenizer
// and capture temperature agree with teacher 0's, and every sample
// committed in teacher 0's cache is committed in every other. window is
// data.shuffle_window: the other caches keep as many decoded chunks as
// teacher 0's shuffled order touches at a time.
func openTeachers(tcs []TeacherCache, window int) (*teacherSet, error) {
	ts := &teacherSet{}
	for i := range tcs {
		tc := &tcs[i]
		ts.names = append(ts.names, tc.teacherName(i))
		ts.weights = append(ts.weights, tc.weight())
		ts.dirs = append(ts.dirs, tc.Dir)
		rd, err := cache.OpenReader(tc.Dir...)
		if err != nil {
			return nil, fmt.Errorf("data.caches[%d] (teacher %s): %w", i, ts.names[i], err)
		}
		ts.rds = append(ts.rds, rd)
		ts.ms = append(ts.ms, rd.Manifest())
	}
	m0 := &ts.ms[0]
	for i := 1; i < len(ts.rds); i++ {
		m := &ts.ms[i]
		differ := func(what string, a, b any, fix string) error {
			return errkind.Errorf(ErrMismatch, "%s has %s %v but %s has %v: %s", ts.where(i), what, b, ts.where(0), a, fix)
		}
		same := "the caches of data.caches must cover the same samples: fill every teacher's cache from the same dataset with the same tokenizer and options"
		switch {
		case m.VocabSize != m0.VocabSize:
			return nil, differ("vocab_size", m0.VocabSize, m.VocabSize, "every teacher must share the student's vocabulary")
		case m.TokenizerFingerprint != m0.TokenizerFingerprint:
			return nil, differ("tokenizer", m0.TokenizerFingerprint, m.TokenizerFingerprint, "every teacher must share the student's tokenizer (cross-tokenizer KD is not supported)")
		case m.DatasetFingerprint != m0.DatasetFingerprint:
			return nil, differ("dataset fingerprint", m0.DatasetFingerprint, m.DatasetFingerprint, same)
		case m.Samples != m0.Samples:
			return nil, differ("sample count", m0.Samples, m.Samples, same)
		case m.Temperature != m0.Temperature:
			return nil, differ("capture temperature", m0.Temperature, m.Temperature,
				"the KD term takes one capture temperature for all teachers: fill one cache again at the other's temperature")
		}
		// Every sample teacher 0 can yield must be in this cache too.
		for _, g := range ts.rds[i].Missing() {
			for _, c := range ts.rds[0].Chunks() {
				if lo, hi := max(g.Start, c.Start), min(g.End, c.End); lo < hi {
					return nil, errkind.Errorf(ErrMismatch, "samples %v are in %s but not in %s (not filled yet: `cachectl status` lists the missing ranges): fill them, so that every teacher covers the same samples",
						cache.Range{Start: lo, End: hi}, ts.where(0), ts.where(i))
				}
			}
		}
		// Teacher 0's order takes window chunks at a time, in a shuffled
		// order; each of them overlaps at most `over` chunks of this cache.
		over := 1
		cs := ts.rds[i].Chunks()
		for _, c := range ts.rds[0].Chunks() {
			n := 0
			for _, d := range cs {
				if d.Start < c.End && c.Start < d.End {
					n++
				}
			}
			over = max(over, n)
		}
		ts.rds[i].SetGetCache(max(window, 1)*over + 1)
	}
	return ts, nil
}

// where names teacher i and its cache directories.
func (ts *teacherSet) where(i int) string {
	return fmt.Sprintf("teacher %s (data.caches[%d], cache %s)", ts.names[i], i, strings.Join(ts.dirs[i], ","))
}

// check refuses a teacher whose vocabulary or tokenizer is not the
// student's, naming it (CheckCache for each).
func (ts *teacherSet) check(cfg *model.Config, tokFP string) error {
	for i := range ts.rds {
		if err := CheckCache(cfg, tokFP, &ts.ms[i], ts.where(i)); err != nil {
			return err
		}
	}
	return nil
}

// teachers are the loss's Teacher entries (weight and k) of the set, with
// no top-k yet: the packer's templates.
func (ts *teacherSet) teachers() []loss.Teacher {
	out := make([]loss.Teacher, len(ts.rds))
	for i := range out {
		// Sampled kinds: the rows of cache.Dense; each teacher's own kind.
		out[i] = loss.Teacher{Weight: ts.weights[i], K: ts.ms[i].DenseK(), Targets: loss.TargetKind(ts.ms[i].Kind())}
	}
	return out
}

// more returns the top-k of teachers 1.. for s, teacher 0's sample,
// after checking that each holds the same tokens and mask.
func (ts *teacherSet) more(s cache.Sample) ([]teacherTopK, error) {
	out := make([]teacherTopK, len(ts.rds)-1)
	for i := 1; i < len(ts.rds); i++ {
		o, err := ts.rds[i].Get(s.Index)
		if err != nil {
			return nil, fmt.Errorf("sample %d of %s: %w", s.Index, ts.where(i), err)
		}
		if err := sameSample(&s, &o); err != nil {
			return nil, errkind.Errorf(ErrMismatch, "sample %d differs between %s and %s: %s; the caches of data.caches must hold the same tokens and masks: fill them from the same dataset with the same tokenizer and options",
				s.Index, ts.where(0), ts.where(i), err)
		}
		m := ts.rds[i].Manifest()
		o = cache.Dense(&m, o) // sampled kinds: fixed-width rows
		out[i-1] = teacherTopK{IDs: o.TopKIDs, LPs: o.TopKLogProbs}
	}
	return out, nil
}

// sameSample says where b's tokens or mask first differ from a's.
func sameSample(a, b *cache.Sample) error {
	if len(a.Tokens) != len(b.Tokens) {
		return fmt.Errorf("%d tokens in the first, %d in the second", len(a.Tokens), len(b.Tokens))
	}
	if !slices.Equal(a.Tokens, b.Tokens) {
		for t := range a.Tokens {
			if a.Tokens[t] != b.Tokens[t] {
				return fmt.Errorf("token %d is %d in the first, %d in the second", t, a.Tokens[t], b.Tokens[t])
			}
		}
	}
	if !slices.Equal(a.Mask, b.Mask) {
		for t := range a.Mask {
			if a.Mask[t] != b.Mask[t] {
				return fmt.Errorf("the loss mask at token %d is %d in the first, %d in the second", t, a.Mask[t], b.Mask[t])
			}
		}
	}
	return nil
}

// get returns sample i of every teacher (evaluation).
func (ts *teacherSet) get(i int64) (cache.Sample, []teacherTopK, error) {
	s, err := ts.rds[0].Get(i)
	if err != nil {
		return s, nil, err
	}
	more, err := ts.more(s)
	return s, more, err
}

// TeacherMetrics are one teacher's numbers in a training step or an
// evaluation of multi-teacher KD (data.caches), means over the loss
// positions.
type TeacherMetrics struct {
	Name   string  `json:"name"`
	Weight float64 `json:"weight"`
	KD     float64 `json:"kd"`             // its divergence, before its weight
	Top1   float64 `json:"top1_agreement"` // how often the student's argmax is its top-1
}

// nameTeachers gives each teacher's metrics the name and weight of the
// teacher at its position.
func nameTeachers(tm []TeacherMetrics, ts []TeacherState) {
	for i := range tm {
		tm[i].Name, tm[i].Weight = ts[i].Name, ts[i].Weight
	}
}

// teachersLine is the per-teacher part of a log line: " [a kd 0.1234
// top1 0.5678, b ...]", or "" with one teacher.
func teachersLine(ts []TeacherMetrics) string {
	if len(ts) == 0 {
		return ""
	}
	parts := make([]string, len(ts))
	for i, t := range ts {
		parts[i] = fmt.Sprintf("%s kd %.4f top1 %.4f", t.Name, t.KD, t.Top1)
	}
	return " [" + strings.Join(parts, ", ") + "]"
}

// teacherScalars adds each teacher's KD and top-1 agreement to the
// TensorBoard scalars sc as PREFIX/kd/NAME and PREFIX/top1_agreement/NAME.
func teacherScalars(sc map[string]float64, prefix string, ts []TeacherMetrics) {
	for _, t := range ts {
		sc[prefix+"/kd/"+t.Name] = t.KD
		sc[prefix+"/top1_agreement/"+t.Name] = t.Top1
	}
}
