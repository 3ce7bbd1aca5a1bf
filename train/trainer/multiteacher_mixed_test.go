package trainer

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"distill/cache"
)

// TestMultiTeacherMixedKinds: data.caches with a top-k cache and a
// sampled one (data.caches[1].targets) trains; at step 1 (the same
// initial student and the same first batch in every run: the order is
// teacher 0's cache's, and both caches share the chunks and seed) each
// teacher's KD is the KD of a run on that teacher's cache alone, and the
// run's KD their weighted sum. Without data.caches[1].targets the
// sampled cache is refused naming the key, and rev_kl is refused for the
// sampled teacher.
func TestMultiTeacherMixedKinds(t *testing.T) {
	f := newOnlineFixture(t, 40)
	for _, kind := range []cache.Targets{cache.TargetsSampled, cache.TargetsHeadSampled} {
		t.Run(string(kind), func(t *testing.T) {
			ta := startTeacherd(t, f.teacher, f.tokDir, filepath.Join(t.TempDir(), "ca"), filepath.Dir(f.file))
			tb := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, filepath.Join(t.TempDir(), "cb"), filepath.Dir(f.file))
			on := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "online"), "", []string{ta.addr()})
			ca := fillCache(t, ta, on)
			son := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "online2"), "", []string{tb.addr()},
				"distill.targets="+string(kind), "distill.samples=10", fmt.Sprintf("distill.k=%d", map[cache.Targets]int{cache.TargetsSampled: 0, cache.TargetsHeadSampled: 2}[kind]))
			cb := f.fillSampled(t, tb, son, kind)
			caches := func(tgt string) string {
				return fmt.Sprintf("data.caches=[{dir: %s, name: a, weight: 0.7}, {dir: %s, name: b, weight: 0.3%s}]", ca, cb, tgt)
			}
			mixed, _ := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "mixed"), ca, nil, "data.cache=[]", caches(", targets: "+string(kind))), Options{})
			alone := func(dir string, over ...string) *Result {
				r, _ := run(t, onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "alone"), dir, nil, over...), Options{})
				return r
			}
			ra, rb := alone(ca), alone(cb, "distill.targets="+string(kind))
			s, sa, sb := mixed.Steps[0], ra.Steps[0], rb.Steps[0]
			if len(s.Teachers) != 2 || s.Tokens != sa.Tokens || s.Tokens != sb.Tokens {
				t.Fatalf("step 1: %+v; alone %d and %d tokens", s, sa.Tokens, sb.Tokens)
			}
			near := func(what string, got, want float64) {
				if math.Abs(got-want) > 1e-6*math.Abs(want) || math.IsNaN(got) {
					t.Fatalf("%s: %v, want %v", what, got, want)
				}
			}
			near("teacher a's kd at step 1", s.Teachers[0].KD, sa.KD)
			near("teacher b's kd at step 1", s.Teachers[1].KD, sb.KD)
			near("kd at step 1", s.KD, 0.7*sa.KD+0.3*sb.KD)
			for _, st := range mixed.Steps {
				if math.IsNaN(st.Loss) || math.IsInf(st.Loss, 0) {
					t.Fatalf("step %d: loss %v", st.Step, st.Loss)
				}
			}
			if len(mixed.Evals) == 0 || len(mixed.Evals[0].Teachers) != 2 {
				t.Fatalf("evals %+v", mixed.Evals)
			}

			_, err := Run(onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "r"), ca, nil, "data.cache=[]", caches("")), Options{})
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "holds targets "+string(kind)) || !strings.Contains(err.Error(), "set data.caches[1].targets: "+string(kind)) {
				t.Fatalf("a sampled cache without its targets: %v", err)
			}
			cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "r2"), ca, nil, "data.cache=[]", caches(", targets: "+string(kind)))
			cfg.Distill.KDLoss = "rev_kl"
			if err := cfg.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "data.caches[1].targets "+string(kind)) || !strings.Contains(err.Error(), "kd_loss rev_kl with targets "+string(kind)) {
				t.Fatalf("rev_kl with a sampled teacher: %v", err)
			}
		})
	}
}
