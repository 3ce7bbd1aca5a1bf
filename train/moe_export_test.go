package train

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"distill/model"
	"distill/train/loss"
)

// TestExportNVFP4MoE: NVFP4 QAD of a Qwen3-MoE student quantizes the
// attention and every expert's Linears (weights and inputs), not the
// routers, embeddings or head; its training steps lower the loss; the
// Model-Optimizer export decodes (with the independent E2M1/E4M3
// decoders) to the fake-quantized weights of every expert exactly, each
// expert's gate/up share one weight_scale_2, the experts of a block share
// their input_scales, and the routers stay BF16 and are listed in
// exclude_modules.
func TestExportNVFP4MoE(t *testing.T) {
	cfg := tinyMoEConfig(false, 1)
	s, err := NewStudent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 2, Std: 0.2, Perturb: true})); err != nil {
		t.Fatal(err)
	}
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}
	b := testBatch(3, cfg.VocabSize, 4)
	plain, err := s.Forward(b, &opt)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
	q, err := s.Forward(b, &opt)
	if err != nil {
		t.Fatal(err)
	}
	if q.Loss == plain.Loss {
		t.Fatalf("QAD loss %g equals the unquantized loss: quantization is off", q.Loss)
	}
	s.ZeroGrad()
	if _, err := s.ForwardBackward(b, &opt, 0); err != nil {
		t.Fatal(err)
	}
	// Move the weights past calibration, as training does.
	for i := range s.Params {
		s.Params[i] *= 1.01
	}
	dir := t.TempDir()
	if err := s.WriteNVFP4(dir); err != nil {
		t.Fatal(err)
	}
	s.Model.QuantizeWeights()
	w, err := model.OpenWeights(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	scalar := func(name string) float32 {
		raw, _, err := w.Raw(name)
		if err != nil {
			t.Fatal(err)
		}
		return math.Float32frombits(binary.LittleEndian.Uint32(raw))
	}
	nq, nExperts := 0, 0
	var routers []string
	for i := range s.Model.Blocks {
		L := &s.Model.Blocks[i]
		for _, l := range L.Linears() {
			wfq, err := s.host(l.Wfq)
			if err != nil {
				t.Fatal(err)
			}
			raw, info, err := w.Raw(l.Name + ".weight")
			if err != nil || info.DType != "U8" || info.Shape[0] != l.Out || info.Shape[1] != l.In/2 {
				t.Fatalf("%s.weight: %v %+v", l.Name, err, info)
			}
			sc, _, err := w.Raw(l.Name + ".weight_scale")
			if err != nil {
				t.Fatal(err)
			}
			g2 := scalar(l.Name + ".weight_scale_2")
			if g2 != l.WQ.Amax/(6*448) {
				t.Fatalf("%s weight_scale_2 %g, want amax/2688 = %g", l.Name, g2, l.WQ.Amax/2688)
			}
			for r := 0; r < l.Out; r++ {
				for c := 0; c < l.In; c++ {
					byt := raw[(r*l.In+c)/2]
					code := byt & 15
					if c%2 == 1 {
						code = byt >> 4
					}
					got := float32(e2m1(code)) * (float32(e4m3(sc[r*(l.In/16)+c/16])) * g2)
					if want := wfq[r*l.In+c]; got != want && !(got == 0 && want == 0) {
						t.Fatalf("%s[%d,%d]: export decodes to %g, training used %g", l.Name, r, c, got, want)
					}
				}
			}
			nq++
		}
		for e := range L.Experts {
			x := &L.Experts[e]
			if g, u := scalar(x.Gate.Name+".weight_scale_2"), scalar(x.Up.Name+".weight_scale_2"); g != u {
				t.Fatalf("%s: gate weight_scale_2 %g, up %g: want one (w13)", x.Gate.Name, g, u)
			}
			for _, c := range []struct {
				l    string
				amax float32
			}{{x.Gate.Name, L.InGateUp.Amax}, {x.Up.Name, L.InGateUp.Amax}, {x.Down.Name, L.InDown.Amax}} {
				if in := scalar(c.l + ".input_scale"); in != c.amax/(6*448) {
					t.Fatalf("%s input_scale %g, want the block's shared %g", c.l, in, c.amax/2688)
				}
			}
			nExperts++
		}
		if L.Router != nil {
			routers = append(routers, L.Router.Name)
			if _, info, err := w.Raw(L.Router.Name + ".weight"); err != nil || info.DType != "BF16" {
				t.Fatalf("router %s should stay BF16: %v %+v", L.Router.Name, err, info)
			}
		}
	}
	// Layers 0 and 2 sparse (4 experts), layer 1 dense.
	if nExperts != 8 || nq != 3*4+3+8*3 || len(routers) != 2 {
		t.Fatalf("%d quantized linears, %d experts, routers %v", nq, nExperts, routers)
	}
	var hq struct {
		Quantization struct {
			ExcludeModules []string `json:"exclude_modules"`
		}
	}
	hb, _ := os.ReadFile(filepath.Join(dir, "hf_quant_config.json"))
	if err := json.Unmarshal(hb, &hq); err != nil || !slices.Equal(hq.Quantization.ExcludeModules, append([]string{"lm_head"}, routers...)) {
		t.Fatalf("hf_quant_config.json exclude_modules %v, want lm_head and the routers %v: %v", hq.Quantization.ExcludeModules, routers, err)
	}
	// A QAD checkpoint's amax round-trip (resume): 4+3·4+4 per MoE layer.
	amax := s.QuantAmax()
	if len(amax) != 2*(4+12+4)+11 {
		t.Fatalf("%d amax values", len(amax))
	}
	s2, _ := NewStudent(cfg)
	if err := s2.Load(s.Weights()); err != nil {
		t.Fatal(err)
	}
	if err := s2.RestoreQAD(amax); err != nil {
		t.Fatal(err)
	}
	r1, _ := s.Forward(b, &opt)
	r2, err := s2.Forward(b, &opt)
	if err != nil || r1.Loss != r2.Loss {
		t.Fatalf("restored QAD loss %v (%v), original %v", r2.Loss, err, r1.Loss)
	}
	if err := s2.RestoreQAD(amax[:len(amax)-1]); err == nil {
		t.Fatal("RestoreQAD with one amax missing: want an error")
	}
}
