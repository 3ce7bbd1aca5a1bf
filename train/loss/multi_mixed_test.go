package loss

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"distill/train/internal/ref"
)

// TestMultiMixedKinds: a top-k teacher (k 5, tail bucket) beside a
// sampled one (sampled, or head+sampled k 3, N 12) at weights 0.7/0.45,
// the run's options topk: the loss against 0.7·(float64 reference of the
// top-k teacher alone) + 0.45·(sampledRef of the sampled teacher alone),
// each teacher's divergence against its own reference, and the gradients
// against central finite differences of that sum (the single-teacher
// tolerances); the same with the teachers' order swapped and the run's
// options of the sampled kind. A sampled teacher beside top-k ones takes
// the sampled rules: rev_kl is refused naming the teacher.
func TestMultiMixedKinds(t *testing.T) {
	for _, kind := range []TargetKind{Sampled, HeadSampled} {
		for _, c := range []struct {
			T    float64
			t2   bool
			sft  float64
			swap bool
		}{{1, false, 0.5, false}, {1.5, true, 0, false}, {1, false, 0.3, true}} {
			t.Run(fmt.Sprintf("%s/T=%g/sft=%g/swap=%v", kind, c.T, c.sft, c.swap), func(t *testing.T) {
				C, V := 6, 50
				a := newBatch(11, C, V, 5)
				sb := sampledBatch(5, C, V, kind, 3, 12)
				o := Options{Targets: TopK, KD: FwdKL, Tail: Bucket, Temperature: c.T, TeacherTemperature: c.T, ScaleT2: c.t2, KDWeight: 0.8, SFTWeight: c.sft}
				ta := Teacher{Weight: 0.7, K: a.K, TopIDs: a.tg.TopIDs, TopLP: a.tg.TopLP}
				tb := Teacher{Weight: 0.45, K: sb.K, TopIDs: sb.tg.TopIDs, TopLP: sb.tg.TopLP, Targets: kind}
				ts, ia, ib := []Teacher{ta, tb}, 0, 1
				if c.swap {
					// The run's kind is the sampled one; the top-k teacher says so.
					o.Targets, ta.Targets, tb.Targets = kind, TopK, ""
					ts, ia, ib = []Teacher{tb, ta}, 1, 0
				}
				tg := multi(a, ts...)
				st, dx, dw := runBoth(t, a, tg, o)
				xd, wd := ref.F64(a.x), ref.F64(a.w)
				sg := a.tg
				sg.K, sg.TopIDs, sg.TopLP = sb.K, sb.tg.TopIDs, sb.tg.TopLP
				f := func() (total, ce, kdA, kdB float64) {
					ro := a.refOpts(o)
					ro.KDWeight, ro.SFTW = o.KDWeight*0.7, 0
					la, kda, c1 := ref.KDLoss(xd, wd, C, V, a.tg.Tokens, a.tg.Starts, a.tg.Mask, a.K, a.tg.TopIDs, a.tg.TopLP, ro)
					so := o
					so.Targets, so.KDWeight, so.SFTWeight = kind, o.KDWeight*0.45, 0
					lb, kdb, _ := sampledRef(xd, wd, C, V, &sg, so)
					return la + lb + o.SFTWeight*c1, c1, kda, kdb
				}
				want, wce, wka, wkb := f()
				closeRel(t, "loss", st.Loss, want, 1e-6, lossRtol)
				closeRel(t, "ce", st.CE, wce, 1e-6, lossRtol)
				closeRel(t, "kd", st.KD, 0.7*wka+0.45*wkb, 1e-6, lossRtol)
				closeRel(t, "top-k teacher's kd", st.Teachers[ia].KD, wka, 1e-6, lossRtol)
				closeRel(t, "sampled teacher's kd", st.Teachers[ib].KD, wkb, 1e-6, lossRtol)
				fl := func() float64 { l, _, _, _ := f(); return l }
				gx, gw := ref.Grad(fl, xd, nil, 1e-5), ref.Grad(fl, wd, nil, 1e-5)
				for i := range gx {
					closeRel(t, fmt.Sprintf("dx[%d]", i), float64(dx[i]), gx[i], gradAtol, gradRtol)
				}
				for i := range gw {
					closeRel(t, fmt.Sprintf("dw[%d]", i), float64(dw[i]), gw[i], gradAtol, gradRtol)
				}
			})
		}
	}
	a := newBatch(11, 6, 50, 5)
	sb := sampledBatch(5, 6, 50, Sampled, 0, 12)
	tg := multi(a, Teacher{Weight: 1, K: a.K, TopIDs: a.tg.TopIDs, TopLP: a.tg.TopLP},
		Teacher{Weight: 1, K: sb.K, TopIDs: sb.tg.TopIDs, TopLP: sb.tg.TopLP, Targets: Sampled})
	o := Options{KD: RevKL, Tail: Bucket, Temperature: 1, KDWeight: 1}
	_, err := (&Head{V: 50, C: 6}).fwd(a.x, a.w, tg, &o)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "teacher 1: ") || !strings.Contains(err.Error(), "kd_loss rev_kl with targets sampled") {
		t.Fatalf("rev_kl with a sampled teacher: %v", err)
	}
}
