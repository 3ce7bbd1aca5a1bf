package trainer

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"distill/cache"
	"distill/data"
	"distill/internal/errkind"
	"distill/model"
	"distill/train/loss"
)

// online is a run's live teachers (distill.teachers) and their
// write-through caches: one pool of replicas per teacher. Every teacher
// answers every sample; with several, the rows carry each teacher's
// top-k in loss.Targets.Teachers exactly as data.caches does.
type online struct {
	cfg      *OnlineConfig
	names    []string
	weights  []float64
	pools    []*teacherPool
	wcs      []*writeCache    // per teacher; nil entries: no write-through
	ms       []cache.Manifest // each teacher as a cache of it would describe it
	m        cache.Manifest   // teacher 0's: the run's
	eval     []cache.Sample   // the eval samples with teacher 0's answers, asked once
	evalMore map[int64][]teacherTopK
	log      io.Writer

	// ctx is cancelled once any teacher's pool has stopped (failed).
	ctx    context.Context
	cancel context.CancelFunc
}

// startOnline dials each teacher's replicas, checks each one's Info
// against the student (tokenizer, vocabulary, k, sample length) before
// step 1, and fills m as a cache of teacher 0 would be: teacher
// fingerprint, k, capture temperature. It opens the write caches: with
// one teacher distill.write_cache itself, with several one per teacher,
// distill.write_cache/<name>.
func startOnline(cfg *Config, sc *model.Config, tokFP string, maxLen int, m *cache.Manifest, log io.Writer) (*online, error) {
	oc := &cfg.Distill.OnlineConfig
	on := &online{cfg: oc, log: log}
	on.ctx, on.cancel = context.WithCancel(context.Background())
	want := infoWant{tokenizer: tokFP, vocab: sc.VocabSize, k: int32(oc.K), maxLen: maxLen, draws: int32(oc.Samples),
		pretokenized: cfg.Data.Dataset != nil && cfg.Data.Dataset.Pretokenized}
	kind, _ := cache.ParseTargets(cfg.Distill.Targets) // validated
	tg := scoreTargets{kind: kind, draws: int32(oc.Samples), dataset: m.DatasetFingerprint}
	// Dial every teacher first, so that their Info checks run together.
	for _, t := range oc.Teachers {
		fmt.Fprintf(log, "teachers: checking teacher %s at %s (Info: tokenizer, vocab, k)\n", t.Name, strings.Join(t.Addrs, ", "))
		pool, err := newTeacherPool(t, oc, want, tg, log)
		if err != nil {
			on.close()
			return nil, err
		}
		on.pools = append(on.pools, pool)
		on.names, on.weights = append(on.names, t.Name), append(on.weights, t.Weight)
		context.AfterFunc(pool.ctx, on.cancel)
	}
	for i, pool := range on.pools {
		in, err := pool.ready()
		if err != nil {
			on.close()
			return nil, err
		}
		t := oc.Teachers[i]
		tm := *m
		tm.TeacherFingerprint, tm.K, tm.Temperature = in.GetTeacherFingerprint(), int(pool.k), float32(oc.CaptureTemperature)
		tm.VocabSize, tm.Encoding, tm.FormatVersion = int(in.GetVocabSize()), cache.Encoding(oc.WriteEncoding), cache.VersionFor(kind)
		asks := fmt.Sprintf("k %d", pool.k)
		if kind != cache.TargetsTopK {
			// As a cache of that kind would describe it (cachectl fill
			// --targets kind --samples N).
			tm.Targets, tm.Draws = kind, oc.Samples
			asks = fmt.Sprintf("targets %s, %d draws a position", kind, oc.Samples)
			if kind == cache.TargetsHeadSampled {
				asks += fmt.Sprintf(" beside a head of k %d", pool.k)
			}
		}
		on.ms = append(on.ms, tm)
		fmt.Fprintf(log, "teachers: teacher %s: %s, %.1fM params, fingerprint %.12s, on %d replica(s); %s at temperature %g; prefetch %d samples%s\n",
			t.Name, in.GetArchitecture(), float64(in.GetParams())/1e6, in.GetTeacherFingerprint(), len(t.Addrs), asks, oc.CaptureTemperature, oc.Prefetch, weightNote(on, i))
	}
	*m = on.ms[0]
	on.m = *m
	on.wcs = make([]*writeCache, len(on.pools))
	if oc.WriteCache != "" && on.multi() {
		// One teacher's write cache is the directory itself: reusing it as
		// the root of several teachers' caches would nest caches.
		if rd, err := cache.OpenReader(oc.WriteCache); err == nil {
			on.close()
			return nil, errkind.Errorf(ErrConfig, "distill.write_cache %s is the cache of one teacher (fingerprint %.12s); with several teachers each writes its own cache under it, %s/<name>: use another directory, or move that cache to %s/<its teacher's name>",
				oc.WriteCache, rd.Manifest().TeacherFingerprint, oc.WriteCache, oc.WriteCache)
		}
	}
	if oc.WriteCache != "" {
		for i := range on.pools {
			dir := on.writeDir(i)
			wc, err := openWriteCache(dir, on.ms[i], oc.ChunkSamples)
			if err != nil {
				on.close()
				return nil, err
			}
			on.wcs[i] = wc
			fmt.Fprintf(log, "teachers: writing every answer of teacher %s through to cache %s (%s encoding, chunks of %d samples)\n", on.names[i], dir, oc.WriteEncoding, oc.ChunkSamples)
		}
	}
	return on, nil
}

// weightNote is the weight part of teacher i's log line (multi-teacher).
func weightNote(on *online, i int) string {
	if len(on.cfg.Teachers) < 2 {
		return ""
	}
	return fmt.Sprintf("; weight %g", on.weights[i])
}

// writeDir is teacher i's write cache: distill.write_cache with one
// teacher, distill.write_cache/<name> with several.
func (on *online) writeDir(i int) string {
	if len(on.cfg.Teachers) == 1 {
		return on.cfg.WriteCache
	}
	return filepath.Join(on.cfg.WriteCache, on.cfg.Teachers[i].Name)
}

// multi reports whether the run has several teachers: its rows then
// carry every teacher's top-k in loss.Targets.Teachers.
func (on *online) multi() bool { return len(on.pools) > 1 }

// teachers are the loss's Teacher entries (weight and k), with no top-k
// yet: the packer's templates (multi-teacher runs).
func (on *online) teachers() []loss.Teacher {
	out := make([]loss.Teacher, len(on.pools))
	for i := range out {
		out[i] = loss.Teacher{Weight: on.weights[i], K: on.ms[i].DenseK()}
	}
	return out
}

// moreOf is teachers 1..'s rows of their answers ans (one per teacher)
// to a sample, as fixed-width rows (cache.Dense: a sampled kind's draws
// become rows of DenseK); nil with one teacher.
func (on *online) moreOf(ans []cache.Sample) []teacherTopK {
	if len(ans) < 2 {
		return nil
	}
	out := make([]teacherTopK, len(ans)-1)
	for j := 1; j < len(ans); j++ {
		d := cache.Dense(&on.ms[j], ans[j])
		out[j-1] = teacherTopK{IDs: d.TopKIDs, LPs: d.TopKLogProbs}
	}
	return out
}

// states are the teachers as a checkpoint records them (nil with one
// teacher, as a data.cache run).
func (on *online) states() []TeacherState {
	if !on.multi() {
		return nil
	}
	out := make([]TeacherState, len(on.pools))
	for i := range out {
		out[i] = TeacherState{Name: on.names[i], Fingerprint: on.ms[i].TeacherFingerprint, Weight: on.weights[i]}
	}
	return out
}

// where names teacher i and its addresses.
func (on *online) where(i int) string {
	return fmt.Sprintf("teacher %s (distill.teachers[%d], at %s)", on.names[i], i, strings.Join(on.cfg.Teachers[i].Addrs, ","))
}

// failed returns the error of the first teacher whose pool stopped.
func (on *online) failed() error {
	for _, p := range on.pools {
		if err := p.failed(); err != nil {
			return err
		}
	}
	return nil
}

// stream starts the training order at (epoch, pos).
func (on *online) stream(ds *data.Dataset, cfg *Config, held cache.Range, workers int, epoch int, pos int64) (sampleStream, error) {
	return newOnlineStream(ds, on, cfg.Seed, cfg.Data.ShuffleWindow, on.cfg.ChunkSamples, held, workers, on.cfg.Prefetch, epoch, pos)
}

// evalSamples gives the eval samples every teacher's top-k: from a
// teacher's write cache where it has them, else asked (once per run). ss
// get teacher 0's; the others' are in the map by sample index
// (multi-teacher runs).
func (on *online) evalSamples(ss []cache.Sample) ([]cache.Sample, map[int64][]teacherTopK, error) {
	if on.eval != nil {
		return on.eval, on.evalMore, nil
	}
	n := len(on.pools)
	ans := make([][]cache.Sample, n) // per teacher, per eval sample
	var jobs []*scoreJob
	var pools []*teacherPool
	for j := 0; j < n; j++ {
		ans[j] = make([]cache.Sample, len(ss))
		for i := range ss {
			if len(ss[i].Tokens) == 0 {
				continue
			}
			if wc := on.wcs[j]; wc != nil {
				if s, ok, err := wc.get(ss[i].Index); err != nil {
					return nil, nil, err
				} else if ok {
					if err := sameSample(&ss[i], &s); err != nil {
						return nil, nil, errkind.Errorf(ErrMismatch, "eval sample %d in write cache %s differs from the dataset's: %s: the cache was written from other data; use another distill.write_cache",
							ss[i].Index, wc.dir, err)
					}
					ans[j][i] = s
					continue
				}
			}
			ans[j][i] = cache.Sample{Index: ss[i].Index, Tokens: ss[i].Tokens, Mask: ss[i].Mask}
			job := &scoreJob{s: &ans[j][i], done: make(chan struct{})}
			jobs, pools = append(jobs, job), append(pools, on.pools[j])
			on.pools[j].submit(job)
		}
	}
	for i, job := range jobs {
		if err := pools[i].wait(job); err != nil {
			return nil, nil, fmt.Errorf("teacher %s: answers for the eval samples: %w", pools[i].name, err)
		}
	}
	var more map[int64][]teacherTopK
	if n > 1 {
		more = map[int64][]teacherTopK{}
	}
	for i := range ss {
		if len(ss[i].Tokens) == 0 {
			continue
		}
		ss[i] = ans[0][i]
		if more != nil {
			all := make([]cache.Sample, n)
			for j := range all {
				all[j] = ans[j][i]
			}
			more[ss[i].Index] = on.moreOf(all)
		}
	}
	on.eval, on.evalMore = ss, more
	return ss, more, nil
}

// close stops the teachers' streams, then commits the complete chunks of
// the write caches.
func (on *online) close() error {
	for _, p := range on.pools {
		p.close()
	}
	on.cancel()
	var first error
	for _, wc := range on.wcs {
		if wc != nil {
			if err := wc.close(); err != nil && first == nil {
				first = err
			}
		}
	}
	return first
}
