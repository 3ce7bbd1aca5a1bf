package trainer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"distill/cache"
	"distill/serve"
)

// fillSampled fills a lossless cache of kind of the whole dataset
// through the daemon's Fill, chunked as the online configs are, with the
// run's draws (distill.samples) and head (distill.k).
func (f onlineFixture) fillSampled(t testing.TB, td *teacherd, cfg *Config, kind cache.Targets) string {
	t.Helper()
	opts, err := cfg.Data.Dataset.options(cfg.Data.SeqLen)
	if err != nil {
		t.Fatal(err)
	}
	spec, err := serve.DatasetSpec(cfg.Data.Dataset.sources(), opts, false)
	if err != nil {
		t.Fatal(err)
	}
	w, err := serve.Dial(td.addr(), serve.DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	plan := serve.FillPlan{Dataset: spec, ChunkSamples: cfg.Distill.ChunkSamples, K: int32(cfg.Distill.K), Encoding: "lossless",
		Targets: string(kind), Samples: int32(cfg.Distill.Samples)}
	if _, err := serve.RunFill(context.Background(), []serve.Worker{w}, plan); err != nil {
		t.Fatal(err)
	}
	return td.cfg.Cache
}

// TestOnlineSampledMatchesOffline is TestOnlineMatchesOffline for the
// sampled kinds: an online run with distill.targets sampled (or
// head+sampled) asks its teacher for draws keyed by the dataset and each
// sample's index, and trains exactly as a run from a cache of that kind
// filled by the same teacher (lossless): losses bit for bit, step for
// step and eval for eval. The online write cache holds the same kind,
// and the other kind's cache is refused by a run of this kind.
func TestOnlineSampledMatchesOffline(t *testing.T) {
	f := newOnlineFixture(t, 40)
	for _, tc := range []struct {
		kind cache.Targets
		over []string
	}{
		{cache.TargetsSampled, []string{"distill.targets=sampled", "distill.samples=12", "distill.k=0"}},
		{cache.TargetsHeadSampled, []string{"distill.targets=head+sampled", "distill.samples=12", "distill.k=3"}},
	} {
		t.Run(string(tc.kind), func(t *testing.T) {
			td := startTeacherd(t, f.teacher, f.tokDir, filepath.Join(t.TempDir(), "cache"), filepath.Dir(f.file))
			wdir := filepath.Join(t.TempDir(), "write")
			on := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "online"), "", []string{td.addr()},
				append([]string{"distill.write_encoding=lossless", "distill.write_cache=" + wdir}, tc.over...)...)
			cdir := f.fillSampled(t, td, on, tc.kind)
			off := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "offline"), cdir, nil, "distill.targets="+string(tc.kind))
			ro, _ := run(t, off, Options{})
			rn, log := run(t, on, Options{})
			sameLosses(t, "online vs offline", rn, ro)
			if rn.Steps[0].KD == 0 || rn.Evals[0].KD == 0 {
				t.Fatalf("online run has no KD term: %+v %+v", rn.Steps[0], rn.Evals[0])
			}
			if !strings.Contains(log, "targets "+string(tc.kind)+", 12 draws a position") {
				t.Errorf("log lacks the targets:\n%s", log)
			}
			rd, err := cache.OpenReader(wdir)
			if err != nil {
				t.Fatal(err)
			}
			if m := rd.Manifest(); m.Kind() != tc.kind || m.Draws != 12 {
				t.Fatalf("write cache: targets %s, %d draws", m.Kind(), m.Draws)
			}
			// The write cache's chunks hold what the fill stored.
			fill, err := cache.OpenReader(cdir)
			if err != nil {
				t.Fatal(err)
			}
			chunks := rd.Chunks()
			if len(chunks) == 0 {
				t.Fatal("the write cache has no chunk")
			}
			for i := chunks[0].Start; i < chunks[0].End; i++ {
				a, err := rd.Get(i)
				if err != nil {
					t.Fatal(err)
				}
				b, err := fill.Get(i)
				if err != nil {
					t.Fatal(err)
				}
				if err := sameTargets(&a, &b); err != nil {
					t.Fatalf("sample %d: write cache vs fill: %v", i, err)
				}
			}
		})
	}
}

// sameTargets says where a's targets first differ from b's (floats
// compared bit for bit).
func sameTargets(a, b *cache.Sample) error {
	eqI := slices.Equal[[]int32]
	sameF32 := func(x, y []float32) bool {
		return slices.EqualFunc(x, y, func(u, v float32) bool { return math.Float32bits(u) == math.Float32bits(v) })
	}
	switch {
	case !eqI(a.TopKIDs, b.TopKIDs) || !sameF32(a.TopKLogProbs, b.TopKLogProbs):
		return errors.New("head differs")
	case !eqI(a.DrawN, b.DrawN) || !eqI(a.DrawIDs, b.DrawIDs) || !eqI(a.DrawCounts, b.DrawCounts):
		return errors.New("draws differ")
	case !sameF32(a.TailMass, b.TailMass):
		return errors.New("tail mass differs")
	}
	return nil
}

// TestOnlineMultiSampledMatchesOffline: two online teachers asked for
// sampled targets train bit for bit as the data.caches run over caches
// of that kind the same daemons filled (per-teacher metrics included):
// each teacher's draws become rows of DenseK (cache.Dense) on both paths.
func TestOnlineMultiSampledMatchesOffline(t *testing.T) {
	f := newOnlineFixture(t, 40)
	for _, tc := range []struct {
		kind cache.Targets
		over []string
	}{
		{cache.TargetsSampled, []string{"distill.targets=sampled", "distill.samples=10", "distill.k=0"}},
		{cache.TargetsHeadSampled, []string{"distill.targets=head+sampled", "distill.samples=10", "distill.k=2"}},
	} {
		t.Run(string(tc.kind), func(t *testing.T) {
			ta := startTeacherd(t, f.teacher, f.tokDir, filepath.Join(t.TempDir(), "ca"), filepath.Dir(f.file))
			tb := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, filepath.Join(t.TempDir(), "cb"), filepath.Dir(f.file))
			on := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "online"), "", []string{ta.addr()},
				append([]string{teachersOver(ta.addr(), tb.addr(), 0.7, 0.3)}, tc.over...)...)
			ca, cb := f.fillSampled(t, ta, on, tc.kind), f.fillSampled(t, tb, on, tc.kind)
			off := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "offline"), ca, nil, "distill.targets="+string(tc.kind),
				"data.cache=[]", fmt.Sprintf("data.caches=[{dir: %s, name: a, weight: 0.7}, {dir: %s, name: b, weight: 0.3}]", ca, cb))
			ro, _ := run(t, off, Options{})
			rn, _ := run(t, on, Options{})
			sameLosses(t, "two online teachers vs data.caches", rn, ro)
			sameTeachers(t, "two online teachers vs data.caches", rn, ro)
			if te := rn.Steps[0].Teachers; te[0].KD == te[1].KD || te[0].KD == 0 {
				t.Fatalf("per-teacher metrics of different teachers: %+v", te)
			}
		})
	}
}

// TestOnlineSampledRefusals: distill.samples and distill.k that do not
// fit distill.targets are refused naming the keys, and distill.samples
// beyond a daemon's max_draws is refused before step 1 naming the flag.
func TestOnlineSampledRefusals(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\ndistill:\n  teachers: [h1:7070]\n"), 0o644)
	for _, c := range []struct {
		over []string
		want string
	}{
		{[]string{"distill.samples=8"}, "distill.samples 8 with distill.targets topk: draws belong to targets sampled or head+sampled"},
		{[]string{"distill.targets=sampled"}, "distill.samples 0 with distill.targets sampled: want 1 to 4096 draws per position"},
		{[]string{"distill.targets=head+sampled", "distill.samples=5000"}, "distill.samples 5000 with distill.targets head+sampled: want 1 to 4096"},
		{[]string{"distill.targets=sampled", "distill.samples=8", "distill.k=4"}, "distill.k 4 with distill.targets sampled: sampled targets have no top-k head"},
		{[]string{"distill.teachers=null", "data.dataset=null", "data.cache=[c]", "distill.samples=8"}, "distill.samples: is for online KD and needs distill.teachers"},
	} {
		_, err := LoadConfig(p, c.over)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want ErrConfig with %q", c.over, err, c.want)
		}
	}
	if _, err := LoadConfig(p, []string{"distill.targets=head+sampled", "distill.samples=8", "distill.k=4"}); err != nil {
		t.Fatalf("head+sampled online: %v", err)
	}

	f := newOnlineFixture(t, 20)
	td := startTeacherd(t, f.teacher, f.tokDir, "", "") // max_draws 64 (the default)
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{td.addr()}, "distill.targets=sampled", "distill.samples=65", "distill.k=0")
	res, err := Run(cfg, Options{Log: io.Discard})
	if err == nil || !strings.Contains(err.Error(), "distill.samples 65 exceeds the daemon's max_draws 64") || !strings.Contains(err.Error(), "--max-draws 65") {
		t.Fatalf("samples beyond max_draws: %v", err)
	}
	if res != nil && len(res.Steps) > 0 {
		t.Fatalf("trained %d steps before the check failed", len(res.Steps))
	}
}
