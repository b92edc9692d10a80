//! Maintenance windows: whether switches may start at an instant, in the window's IANA time zone
//! (jiff with the bundled tz database, so a container without `/usr/share/zoneinfo` works too).

use jiff::{Timestamp, civil::Weekday as CivilWeekday, tz::TimeZone};
use switchyard_crds::v1alpha1::{MaintenanceWindow, Weekday};

use crate::{Error, Result};

/// Parses `HH:MM` into minutes after midnight.
fn minutes(hhmm: &str) -> Option<u32> {
    let (h, m) = hhmm.split_once(':')?;
    let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    (h < 24 && m < 60).then_some(h * 60 + m)
}

fn day_index(day: Weekday) -> i8 {
    match day {
        Weekday::Mon => 0,
        Weekday::Tue => 1,
        Weekday::Wed => 2,
        Weekday::Thu => 3,
        Weekday::Fri => 4,
        Weekday::Sat => 5,
        Weekday::Sun => 6,
    }
}

fn civil_index(day: CivilWeekday) -> i8 {
    day.to_monday_zero_offset()
}

/// Whether `window` is open at `now`. A window whose end is before its start runs past midnight;
/// its `days` name the day it opens.
///
/// # Errors
/// [`Error::TimeZone`] and [`Error::Time`] describe a bad time zone or time for people.
pub fn is_open(window: &MaintenanceWindow, now: Timestamp) -> Result<bool> {
    let tz = TimeZone::get(&window.time_zone).map_err(|_| Error::TimeZone {
        zone: window.time_zone.clone(),
    })?;
    let time = |field: &'static str, value: &str| {
        minutes(value).ok_or_else(|| Error::Time {
            field,
            value: value.to_owned(),
        })
    };
    let start = time("start", &window.start)?;
    let end = time("end", &window.end)?;
    let local = now.to_zoned(tz);
    let minute = u32::from(local.hour().unsigned_abs()) * 60 + u32::from(local.minute().unsigned_abs());
    let today = civil_index(local.weekday());
    let yesterday = (today + 6) % 7;
    let day_ok = |d: i8| window.days.is_empty() || window.days.iter().any(|w| day_index(*w) == d);
    Ok(if start < end {
        day_ok(today) && (start..end).contains(&minute)
    } else {
        (minute >= start && day_ok(today)) || (minute < end && day_ok(yesterday))
    })
}

/// A short description for messages, e.g. `Mon,Tue 22:00-04:00 Europe/Berlin`.
pub fn describe(window: &MaintenanceWindow) -> String {
    let days = if window.days.is_empty() {
        "daily".to_owned()
    } else {
        window
            .days
            .iter()
            .map(|d| format!("{d:?}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    format!("{days} {}-{} {}", window.start, window.end, window.time_zone)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(days: &[Weekday], start: &str, end: &str, tz: &str) -> MaintenanceWindow {
        MaintenanceWindow {
            days: days.to_vec(),
            start: start.into(),
            end: end.into(),
            time_zone: tz.into(),
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn window_table() {
        // 2025-01-06 is a Monday.
        let cases = [
            // (window, instant, open)
            (window(&[], "22:00", "23:00", "UTC"), "2025-01-06T22:30:00Z", true),
            (
                window(&[], "22:00", "23:00", "UTC"),
                "2025-01-06T23:00:00Z",
                false,
            ),
            (
                window(&[], "22:00", "23:00", "UTC"),
                "2025-01-06T21:59:00Z",
                false,
            ),
            (
                window(&[Weekday::Mon], "22:00", "23:00", "UTC"),
                "2025-01-07T22:30:00Z",
                false,
            ),
            (
                window(&[Weekday::Tue], "22:00", "23:00", "UTC"),
                "2025-01-07T22:30:00Z",
                true,
            ),
            // Past midnight: opens Monday 22:00, closes Tuesday 02:00.
            (
                window(&[Weekday::Mon], "22:00", "02:00", "UTC"),
                "2025-01-07T01:00:00Z",
                true,
            ),
            (
                window(&[Weekday::Mon], "22:00", "02:00", "UTC"),
                "2025-01-06T01:00:00Z",
                false,
            ),
            (
                window(&[Weekday::Mon], "22:00", "02:00", "UTC"),
                "2025-01-06T23:00:00Z",
                true,
            ),
            // Time zone: 09:00-10:00 in Berlin (UTC+1 in January) is 08:00-09:00 UTC.
            (
                window(&[], "09:00", "10:00", "Europe/Berlin"),
                "2025-01-06T08:30:00Z",
                true,
            ),
            (
                window(&[], "09:00", "10:00", "Europe/Berlin"),
                "2025-01-06T09:30:00Z",
                false,
            ),
            // The weekday is the local one: Monday 00:30 in Tokyo is Sunday 15:30 UTC.
            (
                window(&[Weekday::Mon], "00:00", "01:00", "Asia/Tokyo"),
                "2025-01-05T15:30:00Z",
                true,
            ),
        ];
        for (i, (w, now, want)) in cases.into_iter().enumerate() {
            assert_eq!(is_open(&w, at(now)), Ok(want), "case {i}: {w:?} at {now}");
        }
    }

    #[test]
    fn bad_time_zone_is_reported() {
        let err = is_open(
            &window(&[], "01:00", "02:00", "Mars/Olympus"),
            at("2025-01-06T00:00:00Z"),
        );
        assert!(err.is_err_and(|e| e.to_string().contains("Mars/Olympus")));
    }

    #[test]
    fn errors_read_for_people() {
        let at0 = at("2025-01-06T00:00:00Z");
        let cases = [
            (
                window(&[], "01:00", "02:00", "Mars/Olympus"),
                "window.timeZone \"Mars/Olympus\" is not a known IANA time zone",
            ),
            (
                window(&[], "25:00", "02:00", "UTC"),
                "window.start \"25:00\" is not HH:MM",
            ),
            (
                window(&[], "01:00", "2am", "UTC"),
                "window.end \"2am\" is not HH:MM",
            ),
        ];
        for (w, want) in cases {
            assert_eq!(is_open(&w, at0).unwrap_err().to_string(), want);
        }
    }
}
