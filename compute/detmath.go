package compute

import "math"

// Exp and Log are float64 exp and log defined by their sequence of IEEE
// operations, each rounded once (products and sums that the algorithm
// keeps apart are never fused; its fused multiply-adds are math.FMA), so
// that a device kernel can compute the same bits: the loss head's pass-2
// coefficients (package train/loss on the host, compute/cuda's
// k_loss_coef on the device, see DeviceLossCoef) must be identical on
// both. math.Exp and math.Log are not such a definition: Go computes them
// in assembly on amd64, arm64 and s390x, and on amd64 Exp takes another
// path on CPUs without FMA.
//
// Exp is the algorithm of Go's amd64 math.Exp on CPUs with FMA (Shibata's
// method: 2^k·e^r, r reduced by ln 2 in two parts and divided by 16, a
// degree-8 Taylor polynomial, squared back four times), and Log that of
// Go's amd64 math.Log (FreeBSD's e_log.c): on such a machine they return
// math.Exp's and math.Log's bits, and the host math of train/loss keeps
// the results it had when it called those. Both are within 1 ulp of the
// exact result.
func Exp(x float64) float64 {
	const (
		log2e    = 1.4426950408889634073599246810018920
		ln2U     = 0.69314718055966295651160180568695068359375
		ln2L     = 0.28235290563031577122588448175013436025525412068e-12
		overflow = 7.09782712893384e+02
	)
	b := math.Float64bits(x)
	if b&^(1<<63) >= 0x7FF0000000000000 { // ±Inf, NaN
		if b == 0xFFF0000000000000 {
			return 0
		}
		return x
	}
	if x > overflow {
		return math.Inf(1)
	}
	// k = x/ln 2 rounded to nearest even, as CVTSD2SL does: a value
	// outside int32 becomes math.MinInt32 (its "integer indefinite"),
	// which underflows below.
	k := int32(math.MinInt32)
	if r := math.RoundToEven(float64(log2e * x)); r >= math.MinInt32 && r <= math.MaxInt32 {
		k = int32(r)
	}
	fk := float64(k)
	r := math.FMA(-ln2U, fk, x)
	r = math.FMA(-ln2L, fk, r)
	r = float64(r * 0.0625)
	p := 2.4801587301587301587e-5
	p = math.FMA(p, r, 1.9841269841269841270e-4)
	p = math.FMA(p, r, 1.3888888888888888889e-3)
	p = math.FMA(p, r, 8.3333333333333333333e-3)
	p = math.FMA(p, r, 4.1666666666666666667e-2)
	p = math.FMA(p, r, 1.6666666666666666667e-1)
	p = math.FMA(p, r, 0.5)
	p = math.FMA(p, r, 1.0)
	// e^r - 1 = r·p, then (e^(r·2^i) - 1) squared back: y ← y·(y+2).
	y := float64(r * p)
	y = float64(y * float64(y+2))
	y = float64(y * float64(y+2))
	y = float64(y * float64(y+2))
	y = math.FMA(y, float64(y+2), 1.0)
	// y·2^k, the exponent biased; a subnormal result in two steps.
	bx := k + 0x3FF
	if bx <= 0 {
		if bx < -52 {
			return 0
		}
		y = float64(y * math.Float64frombits(uint64(bx+0x3FE)<<52))
		bx = 1
	} else if bx >= 0x7FF {
		return math.Inf(1)
	}
	return float64(y * math.Float64frombits(uint64(bx)<<52))
}

// Log is log x (see Exp). Its reduction reads x's exponent field, so a
// subnormal x gets no meaningful result (as amd64's math.Log); callers
// keep their arguments normal (train/loss floors its logs at 1e-30).
func Log(x float64) float64 {
	const (
		hSqrt2 = 7.07106781186547524401e-01
		ln2Hi  = 6.93147180369123816490e-01
		ln2Lo  = 1.90821492927058770002e-10
		l1     = 6.666666666666735130e-01
		l2     = 3.999999999940941908e-01
		l3     = 2.857142874366239149e-01
		l4     = 2.222219843214978396e-01
		l5     = 1.818357216161805012e-01
		l6     = 1.531383769920937332e-01
		l7     = 1.479819860511658591e-01
	)
	b := math.Float64bits(x)
	switch {
	case b&^(1<<63) == 0:
		return math.Inf(-1)
	case int64(b) < 0:
		return math.NaN()
	case b >= 0x7FF0000000000000: // +Inf, NaN
		return x
	}
	// x = f1·2^k with f1 in [√2/2, √2).
	f1 := math.Float64frombits(b&(1<<52-1) | 0x3FE0000000000000)
	k := float64(int64(b>>52&0x7FF) - 0x3FE)
	if !(hSqrt2 < f1) {
		k--
		f1 *= 2
	}
	f := f1 - 1
	s := f / (2 + f)
	s2 := float64(s * s)
	s4 := float64(s2 * s2)
	t1 := float64(s2 * float64(l1+float64(s4*float64(l3+float64(s4*float64(l5+float64(s4*l7)))))))
	t2 := float64(s4 * float64(l2+float64(s4*float64(l4+float64(s4*l6)))))
	R := t1 + t2
	hfsq := float64(float64(0.5*f) * f)
	return float64(k*ln2Hi) - ((hfsq - (float64(s*(hfsq+R)) + float64(k*ln2Lo))) - f)
}
